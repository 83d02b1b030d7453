//! The gRPC side: an echo service and a sink service in tonic, with hand-written prost messages
//! and a service written as `tonic-build` would generate it (no `protoc` needed).
//!
//! `bench.Echo/Echo` returns its argument; `bench.Echo/Sink` returns an empty message (the
//! head-of-line stream). The server runs on a tokio multi-thread runtime and listens on loopback
//! TCP and on a Unix socket; a client is one tonic `Channel` (one HTTP/2 connection) shared by
//! every task of the client.

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper_util::rt::TokioIo;
use tonic::codegen::{http, BoxFuture, Service, StdError};
use tonic::server::NamedService;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

/// The one message of the service: bytes in, bytes out.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Blob {
    /// The payload (`bytes` in the .proto; `Bytes` here so that a clone costs no copy).
    #[prost(bytes = "bytes", tag = "1")]
    pub data: Bytes,
}

const ECHO: &str = "/bench.Echo/Echo";
const SINK: &str = "/bench.Echo/Sink";
/// Messages up to this size (tonic's default limit is 4 MiB; the head-of-line stream sends
/// 16 MiB).
pub const MAX_MESSAGE: usize = 64 << 20;

/// The server side of `bench.Echo`.
#[derive(Clone, Copy, Debug, Default)]
pub struct EchoServer;

impl NamedService for EchoServer {
    const NAME: &'static str = "bench.Echo";
}

fn grpc() -> tonic::server::Grpc<ProstCodec<Blob, Blob>> {
    tonic::server::Grpc::new(ProstCodec::default())
        .apply_max_message_size_config(Some(MAX_MESSAGE), Some(MAX_MESSAGE))
}

impl<B> Service<http::Request<B>> for EchoServer
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        match req.uri().path() {
            ECHO => Box::pin(async move {
                let svc = tower::service_fn(|r: Request<Blob>| async move {
                    Ok::<_, Status>(Response::new(r.into_inner()))
                });
                Ok(grpc().unary(svc, req).await)
            }),
            SINK => Box::pin(async move {
                let svc = tower::service_fn(|r: Request<Blob>| async move {
                    drop(r);
                    Ok::<_, Status>(Response::new(Blob::default()))
                });
                Ok(grpc().unary(svc, req).await)
            }),
            other => {
                let st = Status::unimplemented(format!("no method {other}"));
                Box::pin(async move { Ok(st.into_http()) })
            }
        }
    }
}

/// The running servers: their loopback TCP address and Unix socket path.
#[derive(Debug)]
pub struct Servers {
    /// `127.0.0.1:port`.
    pub tcp: std::net::SocketAddr,
    /// The Unix socket (removed by [`Servers::cleanup`]).
    pub uds: PathBuf,
}

impl Servers {
    /// Start both servers on `rt` (a multi-thread runtime).
    pub fn start(rt: &tokio::runtime::Runtime, uds: PathBuf) -> std::io::Result<Servers> {
        let _ = std::fs::remove_file(&uds);
        let (incoming, tcp, listener) = rt.block_on(async {
            let incoming = TcpIncoming::bind("127.0.0.1:0".parse().expect("an address"))?
                .with_nodelay(Some(true));
            let tcp = incoming.local_addr()?;
            let listener = tokio::net::UnixListener::bind(&uds)?;
            Ok::<_, std::io::Error>((incoming, tcp, listener))
        })?;
        rt.spawn(async move {
            if let Err(e) = Server::builder()
                .add_service(EchoServer)
                .serve_with_incoming(incoming)
                .await
            {
                eprintln!("rpc-bench: the gRPC server over TCP stopped: {e}");
            }
        });
        rt.spawn(async move {
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
            if let Err(e) = Server::builder()
                .add_service(EchoServer)
                .serve_with_incoming(incoming)
                .await
            {
                eprintln!("rpc-bench: the gRPC server over the Unix socket stopped: {e}");
            }
        });
        Ok(Servers { tcp, uds })
    }

    /// Remove the socket file.
    pub fn cleanup(&self) {
        let _ = std::fs::remove_file(&self.uds);
    }
}

/// A client of `bench.Echo`: clone it for every task (they share the connection).
#[derive(Clone, Debug)]
pub struct Client {
    g: tonic::client::Grpc<Channel>,
}

impl Client {
    fn over(ch: Channel) -> Client {
        Client {
            g: tonic::client::Grpc::new(ch)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
        }
    }

    /// Connect over loopback TCP.
    pub async fn tcp(addr: std::net::SocketAddr) -> Result<Client, String> {
        let ch = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| e.to_string())?
            .tcp_nodelay(true)
            .connect()
            .await
            .map_err(|e| format!("connecting to the gRPC server at {addr}: {e:?}"))?;
        Ok(Client::over(ch))
    }

    /// Connect over the Unix socket `path`.
    pub async fn uds(path: &Path) -> Result<Client, String> {
        let p = path.to_path_buf();
        let ch = Endpoint::from_static("http://[::1]:50051")
            .connect_with_connector(tower::service_fn(move |_: http::Uri| {
                let p = p.clone();
                async move {
                    Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(p).await?))
                }
            }))
            .await
            .map_err(|e| format!("connecting to the gRPC server at {}: {e:?}", path.display()))?;
        Ok(Client::over(ch))
    }

    async fn unary(&mut self, path: &'static str, data: Bytes) -> Result<Bytes, String> {
        self.g
            .ready()
            .await
            .map_err(|e| format!("gRPC channel: {e}"))?;
        let r = self
            .g
            .unary(
                Request::new(Blob { data }),
                http::uri::PathAndQuery::from_static(path),
                ProstCodec::<Blob, Blob>::default(),
            )
            .await
            .map_err(|s| format!("gRPC call {path}: {s}"))?;
        Ok(r.into_inner().data)
    }

    /// Echo `data`; the reply's length is checked.
    pub async fn echo(&mut self, data: Bytes) -> Result<(), String> {
        let n = data.len();
        let got = self.unary(ECHO, data).await?;
        if got.len() != n {
            return Err(format!("gRPC echo: {} B back for {n} B", got.len()));
        }
        Ok(())
    }

    /// Send `data` to the sink.
    pub async fn sink(&mut self, data: Bytes) -> Result<(), String> {
        self.unary(SINK, data).await.map(drop)
    }
}
