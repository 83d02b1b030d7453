//! Client side of the `madrun` launcher's bootstrap protocol (being written).
