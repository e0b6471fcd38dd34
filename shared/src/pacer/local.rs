//! The per-process baseline (`PACELINE_PACER=local`): the same model as the
//! shared pacer, kept in this process only, like a single-process client.
//! Many processes each believe they have the whole budget.

use super::model::{self, Ask, CallOutcome, Decision, Estimate, Mode, PacerState, PacingConfig, Who};
use super::snapshot::BudgetSnapshot;
use crate::clock::{Clock, SystemClock};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// See the module's doc.
#[derive(Debug, Clone)]
pub struct LocalPacer {
    models: Arc<Mutex<HashMap<String, PacerState>>>,
    budget: String,
    config: Arc<PacingConfig>,
    clock: Arc<dyn Clock>,
}

impl LocalPacer {
    /// A local pacer on the host clock.
    pub fn new(budget: impl Into<String>, config: PacingConfig) -> Self {
        Self::with_clock(budget, config, Arc::new(SystemClock))
    }

    /// A local pacer on the given clock (tests). It parks no turn (it has no
    /// queue to release one into): its waiters come back at their estimate.
    pub fn with_clock(budget: impl Into<String>, config: PacingConfig, clock: Arc<dyn Clock>) -> Self {
        let config = PacingConfig { parks: false, ..config };
        Self { models: Arc::default(), budget: budget.into(), config: Arc::new(config), clock }
    }

    /// Jitter's random draw (0 when the config has no jitter, so that tests
    /// can compare exact answers).
    fn jitter_u(&self) -> f64 {
        if self.config.jitter_frac > 0.0 {
            rand::random::<f64>()
        } else {
            0.0
        }
    }

    /// See [`super::Pacer::acquire`].
    pub fn acquire(&self, model: &str, id: &str, est: Estimate, mode: Mode, who: &Who<'_>) -> Decision {
        let now = self.clock.now_ms();
        let u = self.jitter_u();
        let mut models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        let state = models.entry(model.to_owned()).or_default();
        model::acquire(state, &self.config, now, &Ask { id, est, mode, who: *who }, u)
    }

    /// See [`super::Pacer::settle`].
    pub fn settle(&self, model: &str, id: &str, outcome: &CallOutcome) {
        let now = self.clock.now_ms();
        let mut models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        let state = models.entry(model.to_owned()).or_default();
        model::settle(state, &self.config, now, id, outcome);
    }

    /// The state of one model (tests, differential checks).
    pub fn state(&self, model: &str) -> PacerState {
        let models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        models.get(model).cloned().unwrap_or_default()
    }

    /// See [`super::Pacer::snapshot`].
    pub fn snapshot(&self) -> Vec<BudgetSnapshot> {
        let now = self.clock.now_ms();
        let models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<_> =
            models.iter().map(|(model, s)| BudgetSnapshot::from_state(&self.budget, model, s, now)).collect();
        out.sort_by(|a, b| a.model.cmp(&b.model));
        out
    }
}
