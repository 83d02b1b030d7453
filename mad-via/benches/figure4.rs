//! Figure 4 sweep (placeholder until written).
fn main() {}
