//! The optional access token: with one configured, every request but `GET /health` must carry
//! `Authorization: Bearer <token>`, or it is answered 401 before any handler runs (so no
//! session is opened, and a WebSocket is refused before the upgrade). Tokens are compared in
//! constant time.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::App;
use super::http::ApiError;

/// The route that stays open without the token (liveness probes).
pub(crate) const OPEN_ROUTE: &str = "/health";

/// A secret that clients present as `Authorization: Bearer <token>`. Its `Debug` does not
/// show it.
#[derive(Clone, PartialEq, Eq)]
pub struct AccessToken(String);

/// Why a string cannot be a token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Empty (after trimming surrounding whitespace).
    #[error("the access token is empty")]
    Empty,
    /// A character that cannot travel in an HTTP header as given.
    #[error(
        "the access token may hold only visible ASCII characters (no spaces or control characters); found {0:?} at character {1}"
    )]
    BadCharacter(char, usize),
}

impl AccessToken {
    /// The token in `text`, with surrounding whitespace (a file's trailing newline) removed.
    pub fn new(text: &str) -> Result<AccessToken, TokenError> {
        let token = text.trim();
        if token.is_empty() {
            return Err(TokenError::Empty);
        }
        if let Some((i, c)) = token
            .chars()
            .enumerate()
            .find(|(_, c)| !c.is_ascii_graphic())
        {
            return Err(TokenError::BadCharacter(c, i));
        }
        Ok(AccessToken(token.to_string()))
    }

    /// The token itself (what a client sends).
    pub fn secret(&self) -> &str {
        &self.0
    }

    /// Whether an `Authorization` header value presents this token.
    fn admits(&self, authorization: Option<&HeaderValue>) -> bool {
        let Some(value) = authorization.map(HeaderValue::as_bytes) else {
            return false;
        };
        // RFC 9110: the scheme is case-insensitive; one or more spaces follow it.
        if value.len() < 7 || !value[..7].eq_ignore_ascii_case(b"bearer ") {
            return false;
        }
        let offered = value[7..].trim_ascii();
        constant_time_eq(offered, self.0.as_bytes())
    }
}

impl std::fmt::Debug for AccessToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AccessToken(<redacted>)")
    }
}

/// Compares two byte strings in time that depends only on their lengths, never on where
/// they first differ.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len().max(b.len());
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..n {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= std::hint::black_box(x ^ y);
    }
    std::hint::black_box(diff) == 0
}

/// Middleware: answers 401 (with `WWW-Authenticate: Bearer`) unless the request is for the
/// open route or presents the configured token; passes everything when no token is set.
pub(crate) async fn require_token(
    State(app): State<Arc<App>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(token) = &app.config.token else {
        return next.run(request).await;
    };
    if request.uri().path() == OPEN_ROUTE
        || token.admits(request.headers().get(header::AUTHORIZATION))
    {
        return next.run(request).await;
    }
    let why = if request.headers().contains_key(header::AUTHORIZATION) {
        "the access token is wrong: send Authorization: Bearer <token> with the server's token"
    } else {
        "this server needs an access token: send Authorization: Bearer <token>"
    };
    tracing::debug!(path = %request.uri().path(), "refused a request without the access token");
    let mut response = ApiError::Status(StatusCode::UNAUTHORIZED, why.to_string()).into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"fathom\""),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_trimmed_and_checked() {
        assert_eq!(AccessToken::new("  abc\n").unwrap().secret(), "abc");
        assert_eq!(AccessToken::new(" \n"), Err(TokenError::Empty));
        assert_eq!(
            AccessToken::new("a b"),
            Err(TokenError::BadCharacter(' ', 1))
        );
        assert!(!format!("{:?}", AccessToken::new("s3cret").unwrap()).contains("s3cret"));
    }

    #[test]
    fn only_the_bearer_token_is_admitted() {
        let t = AccessToken::new("s3cret").unwrap();
        let h = |s: &str| HeaderValue::from_str(s).unwrap();
        assert!(t.admits(Some(&h("Bearer s3cret"))));
        assert!(t.admits(Some(&h("bearer   s3cret "))));
        assert!(!t.admits(None));
        assert!(!t.admits(Some(&h("Bearer s3cre"))));
        assert!(!t.admits(Some(&h("Bearer s3crett"))));
        assert!(!t.admits(Some(&h("Basic s3cret"))));
        assert!(!t.admits(Some(&h("s3cret"))));
        assert!(!t.admits(Some(&h("Bearer"))));
    }

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"", b""));
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"ab\0", b"ab"));
        assert!(!constant_time_eq(b"", b"a"));
    }
}
