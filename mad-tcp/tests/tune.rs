//! `tune=auto` on this driver: two ranks measure the thresholds at open, agree on them, and
//! the channel carries pieces on both sides of every threshold.
//! The body is the kit's (`mad_core::conformance::tune`).

#[test]
fn tune_auto_measures_agrees_and_carries_every_size() {
    mad_core::conformance::tune::measures_agrees_and_carries_every_size(
        || mad_core::Session::builder().driver(mad_tcp::TcpDriver::new()),
        "tcp",
    );
}
