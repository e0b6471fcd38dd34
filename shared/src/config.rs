//! Config pieces shared by the binaries: clap arguments with environment
//! fallbacks (flag > env > default), flattened into each subcommand.
//!
//! Tests build these values directly (`RedisArgs::new(url, prefix)`) and never
//! call `set_var`.

use std::fmt;

/// Where Redis is and which key prefix this deployment uses.
#[derive(Debug, Clone, clap::Args)]
pub struct RedisArgs {
    /// Redis URL (`redis://`, `rediss://` or `redis+unix://`).
    #[arg(long = "redis-url", env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    pub url: String,
    /// Prefix of every Redis key paceline writes.
    #[arg(long = "prefix", env = "PACELINE_PREFIX", default_value = "paceline")]
    pub prefix: String,
}

impl RedisArgs {
    /// A config value built in code (tests, `paceline up`).
    pub fn new(url: impl Into<String>, prefix: impl Into<String>) -> Self {
        Self { url: url.into(), prefix: prefix.into() }
    }

    /// The key namespace.
    pub fn keys(&self) -> crate::keys::Keys {
        crate::keys::Keys::new(self.prefix.clone())
    }
}

/// A secret string whose `Debug` and `Display` never show it.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself; call only where it is sent (an HTTP header).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether no secret was given.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_empty() { "Secret(<empty>)" } else { "Secret(<redacted>)" })
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_print() {
        let s = Secret::new("sk-live-123");
        assert!(!format!("{s:?}").contains("sk-live"));
        assert!(!format!("{s}").contains("sk-live"));
        assert_eq!(s.expose(), "sk-live-123");
    }
}
