//! Send and receive modes (Madeleine II, section 2).

/// What the library may do with a packed piece on the sending side.
///
/// The user API encodes the mode in the method called (see [`Packer`](crate::Packer)), so the
/// borrow checker enforces it; this enum is what the switch and the wire descriptors see.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum SendMode {
    /// The caller may reuse the memory as soon as `pack` returns.
    Safer = 0,
    /// The value is read at `end_packing`: changes made before then are sent.
    Later = 1,
    /// The library chooses; the memory stays untouched until the send is done (the default).
    Cheaper = 2,
}

/// When the received data must be available on the receiving side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum RecvMode {
    /// The data is there when `unpack` returns (e.g. a size needed for the next unpack).
    Express = 0,
    /// The data is there after `end_unpacking`: the library may defer and batch.
    Cheaper = 1,
}

impl SendMode {
    /// All send modes.
    pub const ALL: [SendMode; 3] = [SendMode::Safer, SendMode::Later, SendMode::Cheaper];
    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(SendMode::Safer),
            1 => Some(SendMode::Later),
            2 => Some(SendMode::Cheaper),
            _ => None,
        }
    }
}

impl RecvMode {
    /// All receive modes.
    pub const ALL: [RecvMode; 2] = [RecvMode::Express, RecvMode::Cheaper];
    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(RecvMode::Express),
            1 => Some(RecvMode::Cheaper),
            _ => None,
        }
    }
}

bitflags::bitflags! {
    /// A set of (send mode, receive mode) pairs, used by transmission modules to say which
    /// pieces they accept.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct ModeSet: u8 {
        /// SAFER send, EXPRESS receive.
        const SAFER_EXPRESS = 1 << 0;
        /// SAFER send, CHEAPER receive.
        const SAFER_CHEAPER = 1 << 1;
        /// LATER send, EXPRESS receive.
        const LATER_EXPRESS = 1 << 2;
        /// LATER send, CHEAPER receive.
        const LATER_CHEAPER = 1 << 3;
        /// CHEAPER send, EXPRESS receive.
        const CHEAPER_EXPRESS = 1 << 4;
        /// CHEAPER send, CHEAPER receive.
        const CHEAPER_CHEAPER = 1 << 5;
    }
}

impl ModeSet {
    /// The single pair `(s, r)`.
    pub const fn pair(s: SendMode, r: RecvMode) -> ModeSet {
        ModeSet::from_bits_retain(1 << ((s as u8) * 2 + r as u8))
    }
    /// Every pair.
    pub const ANY: ModeSet = ModeSet::all();
    /// Whether `(s, r)` is in the set.
    pub const fn accepts(self, s: SendMode, r: RecvMode) -> bool {
        self.bits() & ModeSet::pair(s, r).bits() != 0
    }
}
