//! MPI channel benchmark (being written).
fn main() {}
