//! Helpers for the server tests: an environment server on a loopback port in its own thread
//! and runtime, a raw HTTP/1.1 client (so tests can send malformed requests), and raw
//! WebSocket sessions. Every wait has a timeout.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fathom_env::env::Services;
use fathom_env::sandbox::{SandboxConfig, SandboxPool};
use fathom_env::server::{EnvServer, ServerConfig, ServerError};
use fathom_env::sublm::SubLm;
use fathom_rewards::Composite;
use serde_json::Value;
use tungstenite::{Message, WebSocket};

/// How long any single read in these helpers may wait.
pub const IO_TIMEOUT: Duration = Duration::from_secs(60);

/// A server running on 127.0.0.1 in a thread of its own.
pub struct TestServer {
    pub addr: SocketAddr,
    /// The server's access token, if it has one (sent by [`TestServer::sessions`]).
    pub token: Option<String>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<Result<(), ServerError>>>,
}

impl TestServer {
    /// Starts a server over a fresh pool of the crate's worker binary.
    pub fn start(
        config: ServerConfig,
        sandbox: SandboxConfig,
        sub_lm: Arc<dyn SubLm>,
    ) -> TestServer {
        let pool = SandboxPool::new(sandbox).expect("sandbox pool");
        let server = EnvServer::new(Services::new(pool, sub_lm), Composite::default(), config)
            .expect("server config");
        TestServer::start_with(server)
    }

    /// Starts `server` on an ephemeral loopback port.
    pub fn start_with(server: EnvServer) -> TestServer {
        let token = server
            .config()
            .token
            .as_ref()
            .map(|t| t.secret().to_string());
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        listener.set_nonblocking(true).expect("nonblocking");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                server
                    .serve(listener, async move {
                        let _ = stopped.await;
                    })
                    .await
            })
        });
        let server = TestServer {
            addr,
            token,
            stop: Some(stop),
            thread: Some(thread),
        };
        let started = Instant::now();
        while get(addr, "/health").0 != 200 {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "server did not come up"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    /// The `Authorization` header of the server's token (none without one).
    pub fn auth(&self) -> Vec<(&'static str, String)> {
        self.token
            .iter()
            .map(|t| ("Authorization", format!("Bearer {t}")))
            .collect()
    }

    /// `http://127.0.0.1:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Shuts the server down and waits for it (bounded).
    pub fn stop(&mut self) -> Result<(), ServerError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.thread.take() {
            Some(t) => {
                let started = Instant::now();
                while !t.is_finished() {
                    assert!(
                        started.elapsed() < Duration::from_secs(60),
                        "server did not stop"
                    );
                    std::thread::sleep(Duration::from_millis(20));
                }
                t.join().expect("server thread")
            }
            None => Ok(()),
        }
    }

    /// `GET /sessions`: (active, max).
    pub fn sessions(&self) -> (u64, u64) {
        let auth = self.auth();
        let headers: Vec<(&str, &str)> = auth.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (status, body) = request(self.addr, "GET", "/sessions", &headers, b"");
        assert_eq!(status, 200, "{body}");
        (
            body["active_sessions"].as_u64().unwrap(),
            body["max_sessions"].as_u64().unwrap(),
        )
    }

    /// Waits until `/sessions` reports `active` sessions (bounded).
    pub fn wait_sessions(&self, active: u64, within: Duration) {
        let started = Instant::now();
        loop {
            let now = self.sessions().0;
            if now == active {
                return;
            }
            assert!(
                started.elapsed() < within,
                "expected {active} sessions, still {now} after {within:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// Opens a TCP connection to `addr` from the local address `from` (on Linux every 127.x.y.z
/// is a loopback address, so a test can be several clients).
pub fn connect_from(addr: SocketAddr, from: IpAddr) -> std::io::Result<TcpStream> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()?;
    let stream = runtime.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(SocketAddr::new(from, 0))?;
        tokio::time::timeout(Duration::from_secs(5), socket.connect(addr))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
    })?;
    let stream = stream.into_std()?;
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// Sends a raw HTTP/1.1 request and returns the status and the body (JSON if it parses, else
/// a JSON string). Status 0 means the connection failed.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    extra_headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, Value) {
    let Ok(stream) = TcpStream::connect_timeout(&addr, Duration::from_secs(5)) else {
        return (0, Value::Null);
    };
    exchange(stream, addr, method, path, extra_headers, body)
}

/// [`request`] from the local address `from`.
pub fn request_from(
    from: IpAddr,
    addr: SocketAddr,
    method: &str,
    path: &str,
    extra_headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, Value) {
    let Ok(stream) = connect_from(addr, from) else {
        return (0, Value::Null);
    };
    exchange(stream, addr, method, path, extra_headers, body)
}

fn exchange(
    mut stream: TcpStream,
    addr: SocketAddr,
    method: &str,
    path: &str,
    extra_headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, Value) {
    stream.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    stream.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    let chunked = extra_headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("transfer-encoding"));
    if !chunked {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    for (k, v) in extra_headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    if stream.write_all(head.as_bytes()).is_err() {
        return (0, Value::Null);
    }
    if chunked {
        for chunk in body.chunks(64 * 1024) {
            let _ = write!(stream, "{:x}\r\n", chunk.len());
            let _ = stream.write_all(chunk);
            let _ = stream.write_all(b"\r\n");
        }
        let _ = stream.write_all(b"0\r\n\r\n");
    } else {
        // The server may answer (413) and close before reading everything.
        let _ = stream.write_all(body);
    }
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> (u16, Value) {
    let Some(split) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        return (0, Value::String(String::from_utf8_lossy(raw).into_owned()));
    };
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut body = raw[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = Vec::new();
        let mut rest = &body[..];
        while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
            let size = usize::from_str_radix(String::from_utf8_lossy(&rest[..eol]).trim(), 16)
                .unwrap_or(0);
            if size == 0 || rest.len() < eol + 2 + size {
                break;
            }
            out.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
            rest = &rest[eol + 2 + size + 2..];
        }
        body = out;
    }
    let value = serde_json::from_slice(&body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()));
    (status, value)
}

/// `GET path`.
pub fn get(addr: SocketAddr, path: &str) -> (u16, Value) {
    request(addr, "GET", path, &[], b"")
}

/// `POST path` with a JSON body.
pub fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    request(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    )
}

/// A raw WebSocket session.
pub struct Ws {
    pub socket: WebSocket<TcpStream>,
}

impl Ws {
    /// Connects to `/ws` (with an optional query).
    pub fn connect(addr: SocketAddr, query: &str) -> Ws {
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
        Ws::handshake(stream, addr, query, &[]).expect("handshake")
    }

    /// Connects to `/ws` from the local address `from` with extra headers; the handshake's
    /// error (e.g. an HTTP 401) is returned.
    pub fn connect_with(
        from: IpAddr,
        addr: SocketAddr,
        headers: &[(&str, &str)],
    ) -> Result<Ws, tungstenite::Error> {
        let stream = connect_from(addr, from).expect("connect");
        Ws::handshake(stream, addr, "", headers)
    }

    fn handshake(
        stream: TcpStream,
        addr: SocketAddr,
        query: &str,
        headers: &[(&str, &str)],
    ) -> Result<Ws, tungstenite::Error> {
        use tungstenite::client::IntoClientRequest;
        stream.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        stream.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
        let url = format!("ws://{addr}/ws{query}");
        let mut request = url.into_client_request()?;
        for (k, v) in headers {
            request.headers_mut().insert(
                tungstenite::http::HeaderName::from_bytes(k.as_bytes()).expect("header name"),
                tungstenite::http::HeaderValue::from_str(v).expect("header value"),
            );
        }
        let (socket, _) = tungstenite::client::client(request, stream).map_err(|e| match e {
            tungstenite::HandshakeError::Failure(e) => e,
            tungstenite::HandshakeError::Interrupted(_) => {
                tungstenite::Error::Io(std::io::ErrorKind::WouldBlock.into())
            }
        })?;
        Ok(Ws { socket })
    }

    /// Sends a text message.
    pub fn send_text(&mut self, text: &str) {
        self.socket.send(Message::Text(text.into())).expect("send");
    }

    /// Sends a text message the server may refuse while it is still arriving: a reset or a
    /// broken pipe then counts as sent (the server closed the connection on seeing the frame's
    /// header), any other failure fails the test.
    pub fn send_text_refusable(&mut self, text: &str) {
        match self.socket.send(Message::Text(text.into())) {
            Ok(()) => {}
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                ) => {}
            Err(tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed) => {}
            Err(e) => panic!("send: {e:?}"),
        }
    }

    /// Sends a JSON message.
    pub fn send(&mut self, v: &Value) {
        self.send_text(&v.to_string());
    }

    /// The next JSON message, or `None` once the server closed the connection.
    pub fn recv(&mut self) -> Option<Value> {
        loop {
            match self.socket.read() {
                Ok(Message::Text(t)) => {
                    return Some(serde_json::from_str(&t).expect("JSON from the server"));
                }
                Ok(Message::Close(_)) => return None,
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
    }

    /// Sends `v` and returns the answer.
    pub fn call(&mut self, v: &Value) -> Value {
        self.send(v);
        self.recv().expect("an answer")
    }

    /// Asserts the server closes the connection (after any messages, returned).
    pub fn drain_until_closed(&mut self) -> Vec<Value> {
        let mut seen = Vec::new();
        while let Some(v) = self.recv() {
            seen.push(v);
            assert!(seen.len() < 100, "the server keeps talking: {seen:?}");
        }
        seen
    }
}

/// A server config with short limits for tests.
pub fn config(max_sessions: usize) -> ServerConfig {
    ServerConfig {
        max_sessions,
        max_body_bytes: 1 << 20,
        ..ServerConfig::default()
    }
}
