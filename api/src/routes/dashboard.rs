//! The dashboard (`GET /`): one page of plain HTML, CSS and JS, built into the
//! binary with uPlot vendored beside it (`api/assets/`), so it works offline and
//! users need no Node toolchain.
//!
//! The page itself needs no token (it holds no data); every call it makes for
//! data goes to the API with the token the user typed, kept in the browser's
//! `sessionStorage` and sent only as an `Authorization` header, never in a URL.
//! The open-mode `Host` guard applies to these routes as to every other.

use axum::extract::Path;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// What the page may load and where it may connect: this origin only (no CDN),
/// never inside another site's frame. uPlot sizes its elements with inline styles.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
                   img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; \
                   frame-ancestors 'none'";

/// The assets under `/assets/`: name, content type, bytes.
const ASSETS: &[(&str, &str, &str)] = &[
    ("app.js", "text/javascript; charset=utf-8", include_str!("../../assets/app.js")),
    ("app.css", "text/css; charset=utf-8", include_str!("../../assets/app.css")),
    ("uPlot.iife.min.js", "text/javascript; charset=utf-8", include_str!("../../assets/vendor/uPlot.iife.min.js")),
    ("uPlot.min.css", "text/css; charset=utf-8", include_str!("../../assets/vendor/uPlot.min.css")),
];

fn page(content_type: &'static str, body: &'static str) -> Response {
    let mut response = body.into_response();
    let h = response.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    // Small and built in: a reload after an upgrade must not show the old page.
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("content-security-policy", HeaderValue::from_static(CSP));
    h.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    h.insert("referrer-policy", HeaderValue::from_static("no-referrer"));
    response
}

/// The dashboard page (no token needed: it asks for one when the API answers 401).
#[utoipa::path(
    get, path = "/", tag = "operations",
    responses((status = 200, description = "The dashboard (HTML): runs, a run's live transcript, the budget, the fleet", content_type = "text/html")),
)]
pub async fn index() -> Response {
    page("text/html; charset=utf-8", include_str!("../../assets/index.html"))
}

/// The dashboard's script, style sheet and vendored chart library.
pub async fn asset(Path(name): Path<String>) -> Result<Response, ApiError> {
    ASSETS
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, content_type, body)| page(content_type, body))
        .ok_or_else(|| ApiError::NotFound(format!("no asset {name}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_loads_only_assets_it_serves() {
        let html = include_str!("../../assets/index.html");
        for (name, _, body) in ASSETS {
            assert!(html.contains(&format!("/assets/{name}")), "{name} is not linked from the page");
            assert!(!body.is_empty());
        }
        assert!(!html.contains("http://") && !html.contains("https://"), "no CDN: the page works offline");
    }
}
