//! The library's `tracing` events, seen through a capturing subscriber: a channel open is a
//! span carrying the channel, driver, rank and size; a peer that closes its end is reported
//! once, at `info`, by the core (target `mad_core::channel`).
//!
//! (The tcp driver's refused-stranger warnings are checked in `fault_tcp_hostile.rs`, through
//! the tools' own subscriber and `MAD_LOG`.)

#![cfg(feature = "tcp")]

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use madeleine::bootstrap::ThreadBootstrap;
use madeleine::mad_tcp::TcpDriver;
use madeleine::{ChannelConfig, Error, Session};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// One event as seen: level, target, message, the other fields (`name=value`), the names and
/// fields of its enclosing spans (outermost first).
#[derive(Debug, Clone)]
struct Seen {
    level: Level,
    target: String,
    message: String,
    fields: String,
    spans: Vec<(String, String)>,
}

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<Seen>>>);

#[derive(Default)]
struct Fields {
    message: String,
    rest: String,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        } else {
            let _ = write!(self.rest, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message = value.to_string();
        } else {
            let _ = write!(self.rest, " {}={value}", field.name());
        }
    }
}

/// The fields a span was created with, kept in its extensions.
struct SpanFields(String);

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: Context<'_, S>,
    ) {
        let mut f = Fields::default();
        attrs.record(&mut f);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(SpanFields(f.rest));
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut f = Fields::default();
        event.record(&mut f);
        let spans = ctx
            .event_scope(event)
            .map(|scope| {
                scope
                    .from_root()
                    .map(|s| {
                        let fields = s
                            .extensions()
                            .get::<SpanFields>()
                            .map(|f| f.0.clone())
                            .unwrap_or_default();
                        (s.name().to_string(), fields)
                    })
                    .collect()
            })
            .unwrap_or_default();
        self.0.lock().unwrap().push(Seen {
            level: *event.metadata().level(),
            target: event.metadata().target().to_string(),
            message: f.message,
            fields: f.rest,
            spans,
        });
    }
}

fn session(b: ThreadBootstrap) -> Session {
    Session::builder()
        .driver(TcpDriver::new())
        .bootstrap(Box::new(b))
        .build()
        .unwrap()
}

#[test]
fn channel_open_span_and_peer_closed_event() {
    // Both ranks run under the capturing subscriber: with a single (scoped) subscriber,
    // tracing-core computes a callsite's interest from the subscriber of the thread that
    // reaches it first, so a callsite first reached by a thread without it would be disabled
    // for good. Rank 0's events are told apart by their `rank` fields.
    let capture = Capture::default();
    let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(capture.clone()));
    let mut bs = ThreadBootstrap::group(2);
    let b1 = bs.pop().unwrap();
    let b0 = bs.pop().unwrap();
    // Rank 1: open, then close its end.
    let d1 = dispatch.clone();
    let peer = std::thread::spawn(move || {
        tracing::dispatcher::with_default(&d1, || {
            let s = session(b1);
            let ch = s
                .open_channel_with(ChannelConfig::parse("logged", "tcp").unwrap())
                .unwrap();
            ch.close();
            drop(ch);
            s
        })
    });
    // Rank 0 (the tcp driver's accepting thread takes the caller's subscriber).
    let e = tracing::dispatcher::with_default(&dispatch, || {
        let s = session(b0);
        let ch = s
            .open_channel_with(ChannelConfig::parse("logged", "tcp").unwrap())
            .unwrap();
        let e = match ch.begin_unpacking_from(1) {
            Ok(_) => panic!("a message from a peer that only closed"),
            Err(e) => e,
        };
        ch.close();
        e
    });
    drop(peer.join().unwrap());
    assert!(matches!(e, Error::PeerClosed { rank: 1 }), "{e:?}");

    // Rank 0's events: a `rank=0` field on the event or on one of its spans.
    let seen: Vec<Seen> = capture
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|s| {
            s.fields.contains(" rank=0") || s.spans.iter().any(|(_, f)| f.contains(" rank=0"))
        })
        .cloned()
        .collect();
    let all = format!("{seen:#?}");
    let opened = seen
        .iter()
        .find(|s| s.message == "channel opened")
        .unwrap_or_else(|| panic!("no `channel opened` event:\n{all}"));
    assert_eq!(opened.level, Level::DEBUG);
    assert_eq!(opened.target, "mad_core::session");
    let (name, fields) = &opened.spans[0];
    assert_eq!(name, "channel_open");
    for f in ["channel=logged", "driver=tcp", "rank=0", "size=2"] {
        assert!(fields.contains(f), "span fields `{fields}` lack {f}");
    }
    // The tcp driver's handshakes (its connector, mad-core's acceptor) run inside the open's
    // span.
    assert!(
        seen.iter().any(
            |s| (s.target == "mad_tcp::setup" || s.target == "mad_core::accept")
                && s.spans.iter().any(|(n, _)| n == "channel_open")
                && s.spans.iter().any(|(n, _)| n == "tcp_handshakes")
        ),
        "no tcp handshake event inside the open's span:\n{all}"
    );

    let gone: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.message == "connection finished: the peer is gone")
        .collect();
    assert_eq!(gone.len(), 1, "reported once:\n{all}");
    assert_eq!(gone[0].level, Level::INFO);
    assert_eq!(gone[0].target, "mad_core::channel");
    for f in ["channel=logged", "rank=0", "peer=1"] {
        assert!(gone[0].fields.contains(f), "{:?} lacks {f}", gone[0]);
    }
    let closed = seen
        .iter()
        .find(|s| s.message == "channel closed")
        .unwrap_or_else(|| panic!("no `channel closed` event:\n{all}"));
    assert_eq!(closed.level, Level::DEBUG);
}
