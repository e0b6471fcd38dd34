//! The demo's progress lines: the runs submitted through the API and one line
//! each (and one for the budgets) until they all finish.

use std::collections::BTreeMap;
use std::io::IsTerminal as _;
use std::time::Duration;

use anyhow::Context as _;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use serde_json::Value;
use shared::runs::{Run, RunStatus};
use tokio::sync::watch;

use super::Example;
use crate::api_client::ApiClient;

/// `12 345`.
fn thousands(n: u64) -> String {
    let digits: Vec<char> = n.to_string().chars().rev().collect();
    let groups: Vec<String> = digits.chunks(3).map(|g| g.iter().rev().collect()).collect();
    groups.into_iter().rev().collect::<Vec<_>>().join(" ")
}

/// Seconds until an RFC 3339 time, if it is in the future.
fn seconds_until(at: &str) -> Option<f64> {
    let at = time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339).ok()?;
    let left = (at - time::OffsetDateTime::now_utc()).as_seconds_f64();
    Some(left.max(0.0))
}

/// One run's line: `waiting  turn 1/12 · 1 234 tokens · budget 2.3s`.
fn describe_run(run: &Run) -> String {
    let status = run.status.as_str();
    let mut line = format!(
        "{status:<9} turn {}/{} · {} tokens",
        run.turns_completed,
        run.max_turns,
        thousands(run.usage.total_tokens)
    );
    let p = &run.pacing;
    if run.status == RunStatus::Waiting {
        let why = run.wait_reason.map_or("budget", |w| w.as_str());
        match run.next_attempt_at.as_deref().and_then(seconds_until) {
            Some(s) => line.push_str(&format!(" · {why} wait {s:.1}s")),
            None => line.push_str(&format!(" · {why} wait")),
        }
    } else if run.status.is_finished() {
        if p.budget_waits > 0 {
            let waited = p.waited_ms as f64 / 1000.0;
            line.push_str(&format!(" · waited {waited:.1}s for budget ({}×)", p.budget_waits));
        }
        if let Some(e) = &run.error {
            line.push_str(&format!(" · {}: {}", e.kind, e.message));
        }
    }
    if p.rate_limited > 0 {
        line.push_str(&format!(" · {} rate limited", p.rate_limited));
    }
    line
}

/// The budget line: `budget gpt-4.1-mini: 3 210 / 12 000 tokens left, 1 100 reserved`.
fn describe_pacer(pacer: &Value) -> Option<String> {
    let budgets = pacer["budgets"].as_array()?;
    let parts: Vec<String> = budgets
        .iter()
        .filter(|b| !b["limit_tokens"].is_null())
        .map(|b| {
            let n = |k: &str| b[k].as_u64().map(thousands).unwrap_or_else(|| "-".into());
            format!(
                "budget {} ({}): {} / {} tokens left, {} reserved",
                b["budget"].as_str().unwrap_or("?"),
                b["model"].as_str().unwrap_or("?"),
                n("remaining_tokens"),
                n("limit_tokens"),
                n("reserved_tokens"),
            )
        })
        .collect();
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// Submits the examples through the API and shows one line per run until all
/// of them finish (or `stop` turns true). Answers the runs' final statuses.
pub async fn drive(
    api: &ApiClient,
    examples: &[Example],
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<BTreeMap<String, RunStatus>> {
    let multi = MultiProgress::new();
    let fancy = std::io::stderr().is_terminal();
    let width = examples.iter().map(|e| e.name.len() + 12).max().unwrap_or(8);
    let style = ProgressStyle::with_template(&format!("{{spinner}} {{prefix:<{width}}}  {{wide_msg}}"))
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    let budget_bar = multi.add(ProgressBar::new_spinner());
    budget_bar
        .set_style(ProgressStyle::with_template("  {wide_msg}").unwrap_or_else(|_| ProgressStyle::default_spinner()));
    let mut runs = Vec::new();
    for ex in examples {
        let id =
            api.submit(ex.body.to_string(), None).await.with_context(|| format!("submitting example {}", ex.name))?.id;
        let bar = multi.add(ProgressBar::new_spinner());
        bar.set_style(style.clone());
        let label = match ex.body["provider"].as_str() {
            Some(p) => format!("{} ({p})", ex.name),
            None => ex.name.clone(),
        };
        bar.set_prefix(label.clone());
        bar.set_message("queued");
        if fancy {
            bar.enable_steady_tick(Duration::from_millis(120));
        } else {
            eprintln!("submitted {} as {id}", ex.name);
        }
        runs.push((ex.name.clone(), label, id, bar, String::new()));
    }
    let mut finals = BTreeMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    while finals.len() < runs.len() {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => break,
        }
        if *stop.borrow() {
            break;
        }
        if let Ok(p) = api.pacer().await {
            if let Some(line) = describe_pacer(&p) {
                budget_bar.set_message(line);
            }
        }
        for (_, label, id, bar, last) in runs.iter_mut() {
            if finals.contains_key(id.as_str()) {
                continue;
            }
            // A failed poll (the API busy for a moment) is just tried again.
            let Ok(run) = api.run(id).await else { continue };
            let line = describe_run(&run);
            if !fancy {
                // Without a terminal: one plain line whenever the state changes.
                let key = format!("{}/{}/{:?}", run.status.as_str(), run.turns_completed, run.wait_reason);
                if key != *last {
                    eprintln!("{label:<width$}  {line}");
                    *last = key;
                }
            }
            if run.status.is_finished() {
                let mark = if run.status == RunStatus::Completed { "✓" } else { "✗" };
                bar.finish_with_message(format!("{mark} {line}"));
                finals.insert(id.clone(), run.status);
            } else {
                bar.set_message(line);
            }
        }
    }
    budget_bar.finish();
    for (_, _, _, bar, _) in &runs {
        if !bar.is_finished() {
            bar.abandon();
        }
    }
    Ok(runs.iter().filter_map(|(name, _, id, ..)| finals.get(id).map(|s| (name.clone(), *s))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn lines() {
        assert_eq!(thousands(12_345), "12 345");
        assert_eq!(thousands(999), "999");
        let run: Run = serde_json::from_value(json!({"id": "run_1", "status": "completed", "mode": "work",
            "model": "gpt-test", "turns_completed": 3, "max_turns": 12,
            "usage": {"input_tokens": 8000, "output_tokens": 1000, "total_tokens": 9000,
                      "reasoning_tokens": 0, "cached_input_tokens": 0},
            "pacing": {"budget_waits": 2, "waited_ms": 4200, "rate_limited": 0, "retries": 0},
            "wait_reason": null, "next_attempt_at": null, "output_text": "done", "error": null,
            "created_at": "2026-12-02T10:00:00.000Z", "updated_at": "2026-12-02T10:01:00.000Z",
            "finished_at": "2026-12-02T10:01:00.000Z", "metadata": {}}))
        .unwrap();
        assert_eq!(describe_run(&run), "completed turn 3/12 · 9 000 tokens · waited 4.2s for budget (2×)");
    }
}
