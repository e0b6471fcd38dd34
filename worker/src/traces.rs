//! Traces of runs over OTLP/HTTP (README, "Traces"): with
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`)
//! set, a worker exports a span per turn, under it a span per provider call
//! (the OpenTelemetry GenAI conventions) and one per tool call, with budget
//! waits and 429s as span events.
//!
//! One trace per run: the run's record holds a `traceparent` written at its
//! creation (`shared::runs::record::new_traceparent`), and every turn's span,
//! on whichever worker, is a child of it. The spans are `tracing` spans of
//! the target [`TARGET`], bridged by `tracing-opentelemetry`; only that
//! target is exported (the logs' spans and `RUST_LOG` are not involved).
//! Export is batched on the SDK's own thread and never blocks a turn; with
//! the collector down, spans are dropped and runs go on.

use std::sync::OnceLock;
use std::time::Duration;

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState, TracerProvider as _,
};
use opentelemetry_otlp::WithHttpConfig as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::Layer as _;

/// The `tracing` target of the spans and events that are exported.
pub const TARGET: &str = "paceline::trace";

/// A process's trace export: what is batched is flushed when it is dropped.
pub struct Traces(SdkTracerProvider);

impl Drop for Traces {
    fn drop(&mut self) {
        if let Err(error) = self.0.shutdown() {
            tracing::warn!(message = "could not flush the last spans", %error);
        }
    }
}

/// Whether this process exports traces: an OTLP endpoint is set.
pub fn enabled() -> bool {
    ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|s| !s.trim().is_empty()))
        && !std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"))
}

/// Installs the logs (as `shared::telemetry::init`) and, when [`enabled`],
/// the trace export beside them; hold the answer until the process ends.
pub fn init(default_filter: &str, service: &str) -> anyhow::Result<Option<Traces>> {
    if !enabled() {
        shared::telemetry::init(default_filter);
        return Ok(None);
    }
    // The standard OTEL_* variables (endpoint, headers, timeout, protocol) are the exporter's to read.
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(Http::default())
        .build()
        .map_err(|e| anyhow::anyhow!("OTEL_EXPORTER_OTLP_ENDPOINT: {e}"))?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").is_err() {
        resource = resource.with_service_name(service.to_owned());
    }
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource.build()).build();
    let tracer = provider.tracer("paceline");
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        // The spans carry what the conventions name, not where in our code they began.
        .with_location(false)
        .with_threads(false)
        .with_target(false)
        .with_tracked_inactivity(false)
        .with_filter(Targets::new().with_target(TARGET, LevelFilter::INFO));
    shared::telemetry::init_with(default_filter, Some(Box::new(layer)));
    Ok(Some(Traces(provider)))
}

/// The span of one turn of run `run_id`, a child of the run's `traceparent`.
pub fn turn_span(run_id: &str, turn: u32, attempt: u32, traceparent: Option<&str>) -> Span {
    let span = tracing::info_span!(target: TARGET, "turn", otel.name = %format!("turn {turn}"), otel.kind = "consumer",
        paceline.run.id = %run_id, paceline.turn.index = i64::from(turn), paceline.turn.attempt = i64::from(attempt));
    if let Some(parent) = traceparent.and_then(remote_parent) {
        let _ = span.set_parent(parent);
    }
    span
}

/// The span of one provider call (GenAI semantic conventions: a client span
/// `chat <model>`); its answer is recorded with [`record_answer`].
pub fn call_span(provider: &str, model: &str, max_tokens: u32) -> Span {
    tracing::info_span!(target: TARGET, "chat", otel.name = %format!("chat {model}"), otel.kind = "client",
        gen_ai.operation.name = "chat", gen_ai.provider.name = provider, gen_ai.request.model = model,
        // (Integers as i64: a u64 would be exported as a string.)
        gen_ai.request.max_tokens = i64::from(max_tokens),
        gen_ai.response.model = tracing::field::Empty, gen_ai.usage.input_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty, gen_ai.response.finish_reasons = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty, error.type = tracing::field::Empty,
        otel.status_code = tracing::field::Empty)
}

/// What a provider call answered, on its span.
pub fn record_answer(span: &Span, answer: &Option<Result<crate::provider::CallSuccess, crate::provider::CallFailure>>) {
    // (No export: nothing is recorded, nothing formatted.)
    if span.is_disabled() {
        return;
    }
    match answer {
        Some(Ok(ok)) => {
            span.record("http.response.status_code", i64::from(ok.status));
            if let Some(u) = ok.usage {
                span.record("gen_ai.usage.input_tokens", u.tokens.input_tokens.min(i64::MAX as u64) as i64);
                span.record("gen_ai.usage.output_tokens", u.tokens.output_tokens.min(i64::MAX as u64) as i64);
            }
            if let Some(model) = &ok.response_model {
                span.record("gen_ai.response.model", model.as_str());
            }
            let finish = match (&ok.incomplete_reason, ok.tool_calls.is_empty()) {
                (Some(reason), _) => reason.as_str(),
                (None, false) => "tool_calls",
                (None, true) => "stop",
            };
            span.record("gen_ai.response.finish_reasons", finish);
        }
        Some(Err(failure)) => {
            if let Some(status) = failure.status {
                span.record("http.response.status_code", i64::from(status));
            }
            span.record("error.type", format!("{:?}", failure.kind).as_str());
            span.record("otel.status_code", "ERROR");
            if failure.kind == shared::pacer::FailureKind::RateLimited {
                span.in_scope(|| {
                    tracing::info!(name: "rate_limited", target: TARGET,
                        status = failure.status.map_or(0, i64::from),
                        retry_after_ms = failure.headers.retry_after_ms.map_or(-1, |ms| ms.min(i64::MAX as u64) as i64))
                });
            }
        }
        None => {
            span.record("error.type", "cancelled");
        }
    }
}

/// The span of one tool call (`execute_tool <name>`).
pub fn tool_span(name: &str, call_id: &str) -> Span {
    tracing::info_span!(target: TARGET, "execute_tool", otel.name = %format!("execute_tool {name}"),
        otel.kind = "internal", gen_ai.operation.name = "execute_tool", gen_ai.tool.name = name,
        gen_ai.tool.call.id = call_id, error.type = tracing::field::Empty)
}

/// A budget wait, as an event of the current span (the turn's).
pub fn budget_wait(owed_ms: u64, reason: &str) {
    tracing::info!(name: "budget_wait", target: TARGET, owed_ms = owed_ms.min(i64::MAX as u64) as i64, reason);
}

/// The remote parent named by `traceparent` (`00-<trace>-<span>-<flags>`).
fn remote_parent(traceparent: &str) -> Option<opentelemetry::Context> {
    let (trace, span, flags) = shared::runs::record::traceparent_parts(traceparent)?;
    let context = SpanContext::new(
        TraceId::from_hex(trace).ok()?,
        SpanId::from_hex(span).ok()?,
        TraceFlags::new(flags),
        true,
        TraceState::default(),
    );
    context.is_valid().then(|| opentelemetry::Context::new().with_remote_span_context(context))
}

/// The exporter's HTTP client: our reqwest on a runtime of its own, built on
/// the SDK's export thread at its first export (that thread has no runtime;
/// the exporter's bundled clients would bring reqwest's blocking client).
#[derive(Debug, Default)]
struct Http(OnceLock<Option<(tokio::runtime::Runtime, reqwest::Client)>>);

/// How long one export may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The most of a collector's answer read.
const MAX_ANSWER: usize = 64 * 1024;

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for Http {
    async fn send_bytes(
        &self,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        let made = self.0.get_or_init(|| {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
            let client = reqwest::Client::builder().timeout(EXPORT_TIMEOUT).build().ok()?;
            Some((runtime, client))
        });
        let Some((runtime, client)) = made else { return Err("no HTTP client for the trace export".into()) };
        let (parts, body) = request.into_parts();
        let url = parts.uri.to_string();
        let sent = runtime.block_on(async {
            let mut answer = client.request(parts.method, url).headers(parts.headers).body(body).send().await?;
            let status = answer.status();
            let headers = answer.headers().clone();
            // The collector's answer is small (a partial-success message): what is read is capped.
            let mut kept = bytes::BytesMut::new();
            while let Some(chunk) = answer.chunk().await? {
                kept.extend_from_slice(&chunk[..chunk.len().min(MAX_ANSWER - kept.len())]);
                if kept.len() >= MAX_ANSWER {
                    break;
                }
            }
            Ok::<_, reqwest::Error>((status, headers, kept.freeze()))
        })?;
        let (status, headers, body) = sent;
        let mut response = http::Response::builder().status(status).body(body)?;
        *response.headers_mut() = headers;
        Ok(response)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runs_traceparent_is_its_turns_remote_parent() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cx = remote_parent(tp).expect("a valid traceparent");
        let span = cx.span();
        let sc = span.span_context();
        assert_eq!(sc.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(sc.is_remote() && sc.is_sampled());
        assert!(remote_parent("00-00000000000000000000000000000000-00f067aa0ba902b7-01").is_none());
        assert!(remote_parent("garbage").is_none());
    }
}
