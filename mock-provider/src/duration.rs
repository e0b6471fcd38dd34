//! Durations in the shape OpenAI's headers and messages use: Go's
//! `time.Duration` string (`6m0s`, `1.5s`, `13ms`, `23h59m59.9s`).

/// Formats a number of milliseconds the way Go prints a `time.Duration`.
///
/// Sub-second values print as whole milliseconds (`13ms`); from one second on
/// the seconds carry a trimmed fraction (`1.146s`, `1m30.5s`, `6m0s`), as in
/// `x-ratelimit-reset-*` and the "Please try again in …" hint.
pub fn go_duration(ms: u64) -> String {
    if ms == 0 {
        return "0s".to_string();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let hours = ms / 3_600_000;
    let minutes = ms / 60_000 % 60;
    let secs = ms / 1000 % 60;
    let frac = ms % 1000;
    let mut seconds = secs.to_string();
    if frac > 0 {
        let digits = format!("{frac:03}");
        seconds.push('.');
        seconds.push_str(digits.trim_end_matches('0'));
    }
    if hours > 0 {
        format!("{hours}h{minutes}m{seconds}s")
    } else if minutes > 0 {
        format!("{minutes}m{seconds}s")
    } else {
        format!("{seconds}s")
    }
}

/// Microseconds rounded up to whole milliseconds: a reset or a wait is never
/// reported shorter than it is, so a client that honours it is never early.
pub fn ceil_ms(us: u64) -> u64 {
    us.div_ceil(1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_like_go() {
        assert_eq!(go_duration(0), "0s");
        assert_eq!(go_duration(13), "13ms");
        assert_eq!(go_duration(999), "999ms");
        assert_eq!(go_duration(1000), "1s");
        assert_eq!(go_duration(1500), "1.5s");
        assert_eq!(go_duration(1146), "1.146s");
        assert_eq!(go_duration(360_000), "6m0s");
        assert_eq!(go_duration(90_500), "1m30.5s");
        assert_eq!(go_duration(3_723_000), "1h2m3s");
        assert_eq!(go_duration(86_399_900), "23h59m59.9s");
    }

    #[test]
    fn rounds_up_to_milliseconds() {
        assert_eq!(ceil_ms(0), 0);
        assert_eq!(ceil_ms(1), 1);
        assert_eq!(ceil_ms(1000), 1);
        assert_eq!(ceil_ms(1001), 2);
    }
}
