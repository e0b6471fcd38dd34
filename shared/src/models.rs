//! What paceline knows of models by name (SPEC §4a): their context windows
//! and their list prices. A model is found by the longest known name it
//! starts with, so a dated snapshot (`gpt-4o-2024-08-06`,
//! `claude-sonnet-4-5-20250929`) is its family's; a model this table does not
//! know has no window here (a run may give one, `context_window_tokens`; only
//! the provider's own context-length error says it overflowed) and no price
//! (its cost is unknown, never 0).
//!
//! The windows are the providers' published context windows (input and
//! output together); the prices their published list prices per million
//! tokens, standard tier, with Anthropic's 5-minute cache writes — both as
//! [`TABLE_DATE`] says.

/// Context windows in tokens, by name prefix.
const CONTEXT_WINDOWS: &[(&str, u64)] = &[
    ("gpt-5", 400_000),
    ("gpt-4.1", 1_047_576),
    ("gpt-4o", 128_000),
    ("gpt-4-turbo", 128_000),
    ("gpt-4", 8_192),
    ("gpt-3.5-turbo", 16_385),
    ("o1", 200_000),
    ("o3", 200_000),
    ("o4-mini", 200_000),
    ("claude-", 200_000),
];

/// When the built-in tables were last checked against the providers' pages.
pub const TABLE_DATE: &str = "2025-11";

/// What a model's tokens cost, USD per million (SPEC §1 `PACELINE_PRICES`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Price {
    /// Uncached input.
    pub input: f64,
    /// Input read from the prompt cache.
    pub cached_input: f64,
    /// Input written to the prompt cache (OpenAI: as `input`; it charges no write).
    pub cache_write: f64,
    /// Output, reasoning included.
    pub output: f64,
}

impl Price {
    const fn openai(input: f64, cached_input: f64, output: f64) -> Self {
        Self { input, cached_input, cache_write: input, output }
    }

    /// Anthropic: reads at a tenth of the input price, 5-minute writes at 1.25×.
    const fn anthropic(input: f64, output: f64) -> Self {
        Self { input, cached_input: input / 10.0, cache_write: input * 1.25, output }
    }

    /// What `usage` cost at this price: its uncached input, cache reads,
    /// cache writes and output, each at its own rate.
    pub fn cost_usd(&self, usage: &crate::runs::Usage) -> f64 {
        let uncached = usage.input_tokens.saturating_sub(usage.cached_input_tokens + usage.cache_write_tokens);
        (uncached as f64 * self.input
            + usage.cached_input_tokens as f64 * self.cached_input
            + usage.cache_write_tokens as f64 * self.cache_write
            + usage.output_tokens as f64 * self.output)
            / 1e6
    }
}

/// List prices by name prefix.
const PRICES: &[(&str, Price)] = &[
    ("gpt-5", Price::openai(1.25, 0.125, 10.0)),
    ("gpt-5-mini", Price::openai(0.25, 0.025, 2.0)),
    ("gpt-5-nano", Price::openai(0.05, 0.005, 0.4)),
    ("gpt-4.1", Price::openai(2.0, 0.5, 8.0)),
    ("gpt-4.1-mini", Price::openai(0.4, 0.1, 1.6)),
    ("gpt-4.1-nano", Price::openai(0.1, 0.025, 0.4)),
    ("gpt-4o", Price::openai(2.5, 1.25, 10.0)),
    ("gpt-4o-mini", Price::openai(0.15, 0.075, 0.6)),
    ("o3", Price::openai(2.0, 0.5, 8.0)),
    ("o4-mini", Price::openai(1.1, 0.275, 4.4)),
    ("claude-opus-4", Price::anthropic(15.0, 75.0)),
    ("claude-opus-4-5", Price::anthropic(5.0, 25.0)),
    ("claude-sonnet-4", Price::anthropic(3.0, 15.0)),
    ("claude-3-7-sonnet", Price::anthropic(3.0, 15.0)),
    ("claude-haiku-4-5", Price::anthropic(1.0, 5.0)),
    ("claude-3-5-haiku", Price::anthropic(0.8, 4.0)),
];

/// The entry of `table` whose name is the longest prefix of `model`.
fn longest<'t, T: 't>(table: impl Iterator<Item = (&'t str, &'t T)>, model: &str) -> Option<&'t T> {
    table.filter(|(prefix, _)| model.starts_with(prefix)).max_by_key(|(prefix, _)| prefix.len()).map(|(_, v)| v)
}

/// The context window of `model`, in tokens, when this table knows it.
pub fn context_window(model: &str) -> Option<u64> {
    longest(CONTEXT_WINDOWS.iter().map(|(name, w)| (*name, w)), model).copied()
}

/// The price of `model`: from the table given with `PACELINE_PRICES`
/// ([`use_prices`]) when it names the model (or a prefix of it), else the
/// built-in list price, when either knows it.
pub fn price(model: &str) -> Option<Price> {
    let given = GIVEN.read().unwrap_or_else(|e| e.into_inner());
    longest(given.0.iter().map(|(name, p)| (name.as_str(), p)), model)
        .or_else(|| longest(PRICES.iter().map(|(name, p)| (*name, p)), model))
        .copied()
}

/// Prices given over the built-in table (`PACELINE_PRICES`, `--prices`):
/// model names (or prefixes of them) and their prices.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PriceTable(Vec<(String, Price)>);

/// The prices this process was given.
static GIVEN: std::sync::RwLock<PriceTable> = std::sync::RwLock::new(PriceTable(Vec::new()));

/// Puts `table` over the built-in prices for this process.
pub fn use_prices(table: PriceTable) {
    *GIVEN.write().unwrap_or_else(|e| e.into_inner()) = table;
}

impl PriceTable {
    /// Reads `{"MODEL": {"input": 2.0, "cached_input": 0.5, "cache_write":
    /// 2.5, "output": 8.0}}` (USD per million tokens): `input` and `output`
    /// are required; `cached_input` and `cache_write` default to `input`.
    /// Every price a finite number ≥ 0; nothing else is accepted.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let models = value.as_object().ok_or("must be an object of model names")?;
        let mut table = vec![];
        for (model, p) in models {
            let p = p.as_object().ok_or_else(|| format!("{model}: must be an object of prices"))?;
            if let Some(unknown) =
                p.keys().find(|k| !["input", "cached_input", "cache_write", "output"].contains(&k.as_str()))
            {
                return Err(format!("{model}.{unknown}: unknown price (input, cached_input, cache_write, output)"));
            }
            let get = |k: &str| -> Result<Option<f64>, String> {
                match p.get(k) {
                    None => Ok(None),
                    Some(v) => match v.as_f64() {
                        Some(x) if x.is_finite() && x >= 0.0 => Ok(Some(x)),
                        _ => Err(format!("{model}.{k}: must be a number of USD per million tokens, 0 or more")),
                    },
                }
            };
            let input = get("input")?.ok_or_else(|| format!("{model}.input: is required"))?;
            let output = get("output")?.ok_or_else(|| format!("{model}.output: is required"))?;
            let price = Price {
                input,
                cached_input: get("cached_input")?.unwrap_or(input),
                cache_write: get("cache_write")?.unwrap_or(input),
                output,
            };
            table.push((model.clone(), price));
        }
        Ok(Self(table))
    }
}

/// `--prices FILE` (`PACELINE_PRICES`): the file read and checked at start.
pub fn read_prices(path: &str) -> Result<PriceTable, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    PriceTable::from_json(&text).map_err(|e| format!("{path}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_is_its_longest_known_prefix() {
        assert_eq!(context_window("gpt-4o-2024-08-06"), Some(128_000));
        assert_eq!(context_window("gpt-4o-mini"), Some(128_000));
        assert_eq!(context_window("gpt-4"), Some(8_192));
        assert_eq!(context_window("gpt-4.1-mini"), Some(1_047_576));
        assert_eq!(context_window("gpt-5-mini"), Some(400_000));
        assert_eq!(context_window("claude-sonnet-4-5-20250929"), Some(200_000));
        assert_eq!(context_window("o3-mini"), Some(200_000));
        assert_eq!(context_window("llama-3.1-8b"), None);
        assert_eq!(context_window(""), None);
    }

    #[test]
    fn a_price_table_is_read_strictly() {
        let t = PriceTable::from_json(r#"{"my-model": {"input": 2, "output": 8, "cached_input": 0.5}}"#).unwrap();
        assert_eq!(t.0[0].1, Price { input: 2.0, cached_input: 0.5, cache_write: 2.0, output: 8.0 });
        for (bad, says) in [
            ("[1]", "object of model names"),
            ("{", "not JSON"),
            (r#"{"m": 3}"#, "m: must be an object"),
            (r#"{"m": {"input": -1, "output": 1}}"#, "m.input: must be a number"),
            (r#"{"m": {"input": "1", "output": 1}}"#, "m.input: must be a number"),
            (r#"{"m": {"output": 1}}"#, "m.input: is required"),
            (r#"{"m": {"input": 1}}"#, "m.output: is required"),
            (r#"{"m": {"input": 1, "output": 1, "batch": 0.5}}"#, "m.batch: unknown price"),
        ] {
            let err = PriceTable::from_json(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
        assert!(read_prices("/no/such/prices.json").unwrap_err().contains("cannot read /no/such/prices.json"));
    }

    #[test]
    fn each_kind_of_token_is_priced_at_its_own_rate() {
        let sonnet = price("claude-sonnet-4-5-20250929").unwrap();
        assert_eq!((sonnet.input, sonnet.cached_input, sonnet.cache_write, sonnet.output), (3.0, 0.3, 3.75, 15.0));
        assert_eq!(price("gpt-4.1-mini").unwrap().input, 0.4);
        assert_eq!(price("gpt-4.1").unwrap().input, 2.0);
        assert_eq!(price("claude-opus-4-5").unwrap().input, 5.0);
        assert_eq!(price("claude-opus-4-1").unwrap().input, 15.0);
        assert_eq!(price("llama-3.1-8b"), None);
        // 1 M input of which 600 k read and 100 k written, 10 k output.
        let usage = crate::runs::Usage {
            input_tokens: 1_000_000,
            cached_input_tokens: 600_000,
            cache_write_tokens: 100_000,
            output_tokens: 10_000,
            ..Default::default()
        };
        let cost = sonnet.cost_usd(&usage);
        assert!((cost - (0.3 * 3.0 + 0.6 * 0.3 + 0.1 * 3.75 + 0.01 * 15.0)).abs() < 1e-9, "{cost}");
    }
}
