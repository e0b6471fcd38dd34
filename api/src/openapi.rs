//! The OpenAPI document, generated from the handlers' `#[utoipa::path]`
//! annotations and the types they return (the run object is `shared`'s own
//! `Run`, with the `openapi` feature), so it cannot drift from the code.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::routes::{dashboard, events, health, ops, runs};

/// The API's document.
#[derive(OpenApi)]
#[openapi(
    info(title = "paceline", description = "Background agentic LLM runs, paced by one shared budget in Redis."),
    paths(
        runs::submit, runs::list, runs::get, runs::transcript, runs::cancel, runs::retry, events::events,
        ops::pacer, ops::pacer_history, ops::queue, ops::workers, ops::dead, ops::dead_webhooks, ops::redrive_webhook, ops::usage,
        health::healthz, health::readyz, health::metrics, health::openapi, dashboard::index,
    ),
    components(schemas(
        runs::SubmitRun, runs::RunList, runs::Transcript,
        shared::runs::Run, shared::runs::RunStatus, shared::runs::WaitReason, shared::runs::Usage,
        shared::runs::PacingCounters, shared::runs::RunError, shared::runs::TranscriptEntry, shared::pacer::Mode,
        ops::PacerView, ops::BudgetView, ops::HistoryView, shared::pacer::History, ops::QueueView, ops::WorkersView, ops::WorkerView,
        ops::DeadList, ops::DeadView, ops::DeadDeliveries, ops::Redriven, shared::runs::webhooks::DeadDelivery, shared::runs::webhooks::WebhookState, ops::UsageView, ops::UsageRow, shared::runs::usage::UsageTotals,
        shared::pacer::BudgetShape, shared::pacer::bucket::Refill,
        health::Health, health::RedisMemory, crate::error::ErrorBody, crate::error::ErrorDetail,
    )),
    modifiers(&BearerAuth),
    tags(
        (name = "runs", description = "Submit runs and follow them"),
        (name = "operations", description = "The pacer, the queue, the workers, the dead turns, health and metrics"),
    )
)]
pub struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "A tenant's token from PACELINE_API_TOKENS, or the operator's (PACELINE_OPERATOR_TOKEN); \
                         any value in open development mode",
                    ))
                    .build(),
            ),
        );
    }
}

/// The document (built once).
pub fn document() -> &'static utoipa::openapi::OpenApi {
    static DOC: std::sync::OnceLock<utoipa::openapi::OpenApi> = std::sync::OnceLock::new();
    DOC.get_or_init(ApiDoc::openapi)
}

#[cfg(test)]
mod tests {
    /// `BudgetView` flattens the pacer's snapshot: its fields are documented
    /// at the top level, under the API's names.
    #[test]
    fn a_budget_view_documents_the_snapshot_fields() {
        let doc = serde_json::to_value(super::document()).unwrap();
        let schemas = &doc["components"]["schemas"];
        let view = format!("{}{}", schemas["BudgetView"], schemas["BudgetSnapshot"]);
        assert!(view.contains("#/components/schemas/BudgetSnapshot"), "{view}");
        for field in ["remaining_tokens", "reset_in_ms", "blocked_for_ms", "shape", "observed_at", "tenant"] {
            assert!(view.contains(&format!("\"{field}\"")), "BudgetView lacks {field}: {view}");
        }
        assert!(!view.contains("observed_at_ms") && !view.contains("reset_tokens_in_ms"), "{view}");
    }
}
