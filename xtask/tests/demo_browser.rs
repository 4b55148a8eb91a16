//! `cargo xtask demo` end to end in a real browser: the binary serves the page for a scripted
//! tiny model (tests/common), headless Chromium is driven over WebDriver (JSON over HTTP to
//! Debian's `chromedriver`), the test types a document and a question into the page, starts
//! the episode, and waits — bounded — until the answer arrives through the server-sent events;
//! it then checks the answer, the streamed transcript (the code, the `llm()` call, the REPL's
//! output) and the summary, and takes a screenshot.
//!
//! The screenshot goes to a temporary file; with `FATHOM_DEMO_SCREENSHOT=PATH` it is written
//! to PATH instead (docs/demo.png was made with `FATHOM_DEMO_SCREENSHOT=$PWD/docs/demo.png`).
//! Nothing is compared about its pixels. Without `chromium` and `chromedriver` on the PATH the
//! test fails and names the Debian packages to install (`.ci/run` installs them).

mod common;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use common::{SCRIPTED_ANSWER, SCRIPTED_CODE, scripted_model};
use serde_json::{Value, json};

const XTASK: &str = env!("CARGO_BIN_EXE_xtask");
const DOCUMENT: &str = "The vault ledger, page one. Entries follow in order of arrival.\n\
    Vault K-12 holds access code 7731-QX. Vault K-13 holds access code 9902-LM.";
const QUESTION: &str = "What is the access code for vault K-12?";
/// The W3C WebDriver key of an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";
/// How long each wait may take: the server's start, chromedriver's start, the episode.
const SERVER_START: Duration = Duration::from_secs(120);
const DRIVER_START: Duration = Duration::from_secs(30);
const EPISODE: Duration = Duration::from_secs(180);

/// A child process that is killed when the test ends, however it ends.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The first file named `name` in a directory of the PATH.
fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Chromium and chromedriver, or a failure naming the packages that provide them.
fn browser() -> (PathBuf, PathBuf) {
    let chromium = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find_map(on_path);
    let driver = on_path("chromedriver");
    match (chromium, driver) {
        (Some(c), Some(d)) => (c, d),
        (c, d) => panic!(
            "the browser test needs headless Chromium and its WebDriver: {} not found on the \
             PATH; install Debian's `chromium` and `chromium-driver` packages \
             (`apt-get install chromium chromium-driver`, as .ci/run does)",
            match (c, d) {
                (None, None) => "`chromium` and `chromedriver` were",
                (None, Some(_)) => "`chromium` was",
                _ => "`chromedriver` was",
            }
        ),
    }
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `xtask demo` for `model` and waits until it serves `/api/info`.
fn start_demo(model: &Path) -> (Guard, String) {
    let port = free_port();
    let mut child = Command::new(XTASK)
        .args([
            "demo",
            "--backend",
            "cpu",
            "--port",
            &port.to_string(),
            "--model",
        ])
        .arg(model)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("xtask starts");
    // Keep the server's log, to show it if the test fails.
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("[demo] {line}");
        }
    });
    let mut guard = Guard(child);
    let base = format!("http://127.0.0.1:{port}");
    let start = Instant::now();
    loop {
        if let Ok(r) = ureq::get(&format!("{base}/api/info")).call() {
            let info: Value = r.into_json().unwrap();
            assert_eq!(
                info["backend"].as_str().map(|b| b.starts_with("cpu")),
                Some(true),
                "{info}"
            );
            return (guard, base);
        }
        if let Some(status) = guard.0.try_wait().unwrap() {
            panic!("xtask demo exited ({status}) before serving; its log is above");
        }
        assert!(
            start.elapsed() < SERVER_START,
            "xtask demo did not answer on {base} within {SERVER_START:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A WebDriver session of headless Chromium.
struct Browser {
    url: String,
    _driver: Guard,
}

impl Browser {
    fn start(chromium: &Path, chromedriver: &Path) -> Browser {
        let port = free_port();
        let driver = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", chromedriver.display()));
        let mut driver = Guard(driver);
        let base = format!("http://127.0.0.1:{port}");
        let start = Instant::now();
        loop {
            let ready = ureq::get(&format!("{base}/status"))
                .call()
                .ok()
                .and_then(|r| r.into_json::<Value>().ok())
                .is_some_and(|v| v["value"]["ready"] == true);
            if ready {
                break;
            }
            if let Some(status) = driver.0.try_wait().unwrap() {
                panic!("chromedriver exited ({status}) before it was ready");
            }
            assert!(
                start.elapsed() < DRIVER_START,
                "chromedriver not ready within {DRIVER_START:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1360,1000"],
            },
        }}});
        let session = post(&format!("{base}/session"), caps);
        let id = session["sessionId"]
            .as_str()
            .expect("a session id")
            .to_string();
        Browser {
            url: format!("{base}/session/{id}"),
            _driver: driver,
        }
    }

    fn post(&self, path: &str, body: Value) -> Value {
        post(&format!("{}{path}", self.url), body)
    }

    fn get(&self, path: &str) -> Value {
        match ureq::get(&format!("{}{path}", self.url)).call() {
            Ok(r) => r.into_json::<Value>().unwrap()["value"].take(),
            Err(e) => panic!("WebDriver GET {path}: {}", describe(e)),
        }
    }

    /// The element that `css` selects (the first).
    fn find(&self, css: &str) -> String {
        let v = self.post("/element", json!({"using": "css selector", "value": css}));
        v[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element `{css}`: {v}"))
            .to_string()
    }

    /// The rendered text of the element that `css` selects ("" while it is hidden).
    fn text(&self, css: &str) -> String {
        let e = self.find(css);
        self.get(&format!("/element/{e}/text"))
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Runs `script` in the page and returns its value.
    fn script(&self, script: &str) -> Value {
        self.post("/execute/sync", json!({"script": script, "args": []}))
    }

    fn type_into(&self, css: &str, text: &str) {
        let e = self.find(css);
        self.post(&format!("/element/{e}/value"), json!({"text": text}));
    }

    fn click(&self, css: &str) {
        let e = self.find(css);
        self.post(&format!("/element/{e}/click"), json!({}));
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = ureq::delete(&self.url).call();
    }
}

fn describe(e: ureq::Error) -> String {
    match e {
        ureq::Error::Status(code, r) => format!("{code}: {}", r.into_string().unwrap_or_default()),
        e => e.to_string(),
    }
}

fn post(url: &str, body: Value) -> Value {
    match ureq::post(url).send_json(body) {
        Ok(r) => r.into_json::<Value>().unwrap()["value"].take(),
        Err(e) => panic!("WebDriver POST {url}: {}", describe(e)),
    }
}

#[test]
fn the_page_streams_an_episode_and_shows_its_answer() {
    let (chromium, chromedriver) = browser();
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("scripted");
    scripted_model(&model);
    let (_demo, base) = start_demo(&model);
    let browser = Browser::start(&chromium, &chromedriver);

    browser.post("/url", json!({"url": format!("{base}/")}));
    assert_eq!(browser.get("/title"), "Fathom · RLM demo");
    // The page asked the server who it is.
    let start = Instant::now();
    while browser.text("#backend") == "…" {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the page never showed /api/info"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(browser.text("#backend").starts_with("cpu"));
    assert!(browser.text("#model").contains("scripted"));

    browser.type_into("#document", DOCUMENT);
    browser.type_into("#question", QUESTION);
    assert_eq!(
        browser.script("return document.getElementById('document').value"),
        DOCUMENT
    );
    browser.click("#run");

    let start = Instant::now();
    let answer = loop {
        let answer = browser.text("#answer");
        if !answer.is_empty() {
            break answer;
        }
        let error = browser.text("#error");
        assert!(error.is_empty(), "the page shows an error: {error}");
        if start.elapsed() > EPISODE {
            panic!(
                "no answer on the page after {EPISODE:?}; status: {:?}; transcript so far:\n{}",
                browser.text("#status-text"),
                browser.text("#transcript")
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    assert_eq!(answer, SCRIPTED_ANSWER);

    // The transcript streamed in: the question, turn 1's highlighted code, the llm() call, the
    // REPL's output (open, being short), turn 2's answer chip; then the summary.
    let transcript = browser.text("#transcript");
    let expect = [
        QUESTION,
        "Turn 1",
        SCRIPTED_CODE,
        "llm(\"The vault ledger, page one.",
        "Output",
        "1 llm() call",
        "Turn 2",
        "answer: 42",
    ];
    let mut at = 0;
    for e in expect {
        let found = transcript[at..].find(e).unwrap_or_else(|| {
            panic!("`{e}` missing (in order) from the page's transcript:\n{transcript}")
        });
        at += found + e.len();
    }
    let highlighted = browser.script(
        "return Array.from(document.querySelectorAll('pre.code span.bi')).map(s => s.textContent)",
    );
    assert_eq!(
        highlighted,
        json!(["print", "llm", "context"]),
        "code highlighting"
    );
    let summary = browser.text("#summary");
    assert!(
        summary.starts_with("answered · 2 turns · 1 llm() calls"),
        "{summary}"
    );
    assert!(
        browser.text("#reward").is_empty(),
        "a custom question is not scored"
    );
    // The stream ends just after the answer: then the page stops being busy.
    let start = Instant::now();
    while !browser.text("#status-text").is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the page still says {:?} after the episode",
            browser.text("#status-text")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        browser.script("return document.getElementById('run').disabled"),
        false
    );

    let png = browser.get("/screenshot");
    let png = base64::engine::general_purpose::STANDARD
        .decode(png.as_str().expect("a base64 screenshot"))
        .unwrap();
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n"),
        "the screenshot is a PNG"
    );
    let path = std::env::var_os("FATHOM_DEMO_SCREENSHOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| dir.path().join("demo.png"));
    std::fs::write(&path, &png).unwrap();
    eprintln!("screenshot: {} ({} bytes)", path.display(), png.len());
}
