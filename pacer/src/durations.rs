//! Parsing the durations and instants providers put in rate-limit headers.
//!
//! Every parser here answers `Option<u64>` milliseconds: a value we cannot read
//! is ignored (`None`), never fatal and never a panic — a malformed header must
//! not take a turn down: anything else is ignored, not fatal.
//!
//! Every conversion rounds **up**: a reset of `1.0001ms` is 2 ms, not 1. A
//! delay that comes out shorter than the server's number sends the retry back
//! into a window we were just told is closed — "a wait cut short is not a wait
//! saved" (docs/pacing.md).
//!
//! Instants (`2026-11-30T10:00:05Z`, HTTP dates) are turned into "ms from
//! `now_ms`" with `now_ms` passed in: no function here reads a clock.

use std::time::UNIX_EPOCH;

use crate::Millis;

/// Attoseconds (10⁻¹⁸ s) per nanosecond. Durations are summed in attoseconds so
/// that every decimal fraction a provider realistically sends (`1.146s`,
/// `1m30.5s`, `0.5us`) is represented exactly before the final round-up to ms.
const AS_PER_NS: u128 = 1_000_000_000;
/// Attoseconds per millisecond.
const AS_PER_MS: u128 = 1_000_000 * AS_PER_NS;
/// Fraction digits kept exactly; later digits only ever round the value up.
const EXACT_FRACTION_DIGITS: usize = 16;

/// Parses a Go-style duration as providers send it in `x-ratelimit-reset-*`
/// (`6m0s`, `1m30.5s`, `1.5s`, `13ms`, `2m`, `1h2m3s`, `0s`; units `h`, `m`,
/// `s`, `ms`, `us`, `µs`, `μs`, `ns`), or a bare number of seconds (`20`,
/// `1.5`), into milliseconds, rounded up.
///
/// Surrounding whitespace is ignored. Anything else — a sign, an exponent,
/// `NaN`, `inf`, inner spaces, an unknown unit, an empty string, a value that
/// does not fit in `u64` milliseconds — is `None`.
pub fn parse_duration_ms(s: &str) -> Option<u64> {
    let s = s.trim();
    if s.is_empty() {
        return None;
    }
    // A bare number is seconds (`retry-after: 2`; Go itself only allows a bare `0`).
    if let Some(ms) = parse_scaled(s, 1000 * AS_PER_MS) {
        return Some(ms);
    }
    let mut rest = s;
    let mut total_as: u128 = 0;
    while !rest.is_empty() {
        let (int, frac, after_number) = split_number(rest)?;
        // The unit runs to the next digit or '.'; both are ASCII, so the split
        // falls on a char boundary even after a multi-byte `µ`.
        let unit_len = after_number.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(after_number.len());
        let (unit, next) = after_number.split_at(unit_len);
        let term = scaled_as(int, frac, unit_as(unit)?)?;
        total_as = total_as.checked_add(term)?;
        rest = next;
    }
    as_to_ms_ceil(total_as)
}

/// Parses a rate-limit reset: a duration as [`parse_duration_ms`] reads it
/// (OpenAI), or an RFC 3339 instant (Anthropic, `2026-11-30T10:00:05Z`, with
/// fractional seconds and offsets), into milliseconds from `now_ms`, rounded
/// up. An instant already past is `Some(0)`: the window is open now.
pub fn parse_reset_ms(value: &str, now_ms: Millis) -> Option<u64> {
    let value = value.trim();
    if let Some(ms) = parse_duration_ms(value) {
        return Some(ms);
    }
    let instant = time::OffsetDateTime::parse(value, &time::format_description::well_known::Rfc3339).ok()?;
    ns_until(instant.unix_timestamp_nanos(), now_ms)
}

/// Parses a `Retry-After` value: a non-negative number of seconds (integer or
/// decimal, rounded up to ms) or an HTTP date (IMF-fixdate, and the obsolete
/// RFC 850 and asctime forms) into milliseconds from `now_ms`; a date already
/// past is `Some(0)`.
///
/// Negative values are `None`: Azure sends `-1` to mean "no advice", and
/// reading it as "retry now" would skip the backoff ladder.
pub fn parse_retry_after_ms(value: &str, now_ms: Millis) -> Option<u64> {
    let value = value.trim();
    if let Some(ms) = parse_scaled(value, 1000 * AS_PER_MS) {
        return Some(ms);
    }
    let at = httpdate::parse_http_date(value).ok()?;
    // httpdate only yields years from 1970, so this never fails in practice;
    // if it did, the value is simply ignored.
    let since_epoch = at.duration_since(UNIX_EPOCH).ok()?;
    ns_until(i128::try_from(since_epoch.as_nanos()).ok()?, now_ms)
}

/// Parses a plain non-negative number of milliseconds (`retry-after-ms`,
/// `x-ms-retry-after-ms`: `1500`, or `1500.5` rounded up to 1501). Negative
/// values (Azure's `-1`) and anything else are `None`.
pub fn parse_millis(value: &str) -> Option<u64> {
    parse_scaled(value.trim(), AS_PER_MS)
}

/// A bare decimal number (no unit, no sign) times `unit_as`, in ms rounded up.
fn parse_scaled(s: &str, unit_as: u128) -> Option<u64> {
    let (int, frac, rest) = split_number(s)?;
    if !rest.is_empty() {
        return None;
    }
    as_to_ms_ceil(scaled_as(int, frac, unit_as)?)
}

/// Splits a leading unsigned decimal number (`12`, `1.5`, `.5`, `1.`) into its
/// integer digits, fraction digits and the rest. `None` when there are no
/// digits at all.
fn split_number(s: &str) -> Option<(&str, &str, &str)> {
    let int_len = s.bytes().take_while(u8::is_ascii_digit).count();
    let (int, rest) = s.split_at(int_len);
    let (frac, rest) = match rest.strip_prefix('.') {
        Some(after_dot) => {
            let frac_len = after_dot.bytes().take_while(u8::is_ascii_digit).count();
            after_dot.split_at(frac_len)
        }
        None => ("", rest),
    };
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    Some((int, frac, rest))
}

/// Attoseconds in one unit of a Go duration.
fn unit_as(unit: &str) -> Option<u128> {
    Some(match unit {
        "ns" => AS_PER_NS,
        // Go accepts both the micro sign (U+00B5) and the Greek mu (U+03BC).
        "us" | "µs" | "μs" => 1_000 * AS_PER_NS,
        "ms" => AS_PER_MS,
        "s" => 1_000 * AS_PER_MS,
        "m" => 60_000 * AS_PER_MS,
        "h" => 3_600_000 * AS_PER_MS,
        _ => return None,
    })
}

/// `int.frac × unit_as` in attoseconds, rounded up; `None` on overflow.
/// `int` and `frac` hold ASCII digits only.
fn scaled_as(int: &str, frac: &str, unit_as: u128) -> Option<u128> {
    let mut whole: u128 = 0;
    for d in int.bytes() {
        whole = whole.checked_mul(10)?.checked_add(u128::from(d - b'0'))?;
    }
    let mut total = whole.checked_mul(unit_as)?;
    if !frac.is_empty() {
        let kept_len = frac.len().min(EXACT_FRACTION_DIGITS);
        let (kept, dropped) = frac.split_at(kept_len);
        let numerator: u128 = kept.bytes().fold(0, |n, d| n * 10 + u128::from(d - b'0'));
        let denominator = 10u128.pow(kept_len as u32);
        // ≤ 10¹⁶ × 3.6·10²¹ < u128::MAX, so this cannot overflow.
        total = total.checked_add((numerator * unit_as).div_ceil(denominator))?;
        if dropped.bytes().any(|d| d != b'0') {
            // What the dropped digits are worth is below one step of the last
            // kept digit; adding a whole step can only round up, never down.
            total = total.checked_add(unit_as.div_ceil(denominator))?;
        }
    }
    Some(total)
}

/// Attoseconds to whole milliseconds, rounded up; `None` beyond `u64`.
fn as_to_ms_ceil(total_as: u128) -> Option<u64> {
    u64::try_from(total_as.div_ceil(AS_PER_MS)).ok()
}

/// Milliseconds from `now_ms` until the instant `at_ns` (ns since the epoch),
/// rounded up; 0 when the instant is not in the future.
fn ns_until(at_ns: i128, now_ms: Millis) -> Option<u64> {
    let delta_ns = at_ns - i128::from(now_ms) * 1_000_000;
    if delta_ns <= 0 {
        return Some(0);
    }
    // delta_ns > 0, so the cast is lossless.
    u64::try_from((delta_ns as u128).div_ceil(1_000_000)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// 2026-11-30T10:00:00Z in ms since the epoch.
    const NOW: Millis = 1_796_032_800_000;

    #[test]
    fn now_constant_is_the_instant_the_tests_say() {
        let t = time::OffsetDateTime::from_unix_timestamp(NOW / 1000).unwrap();
        assert_eq!(t.format(&time::format_description::well_known::Rfc3339).unwrap(), "2026-11-30T10:00:00Z");
    }

    #[test]
    fn durations_as_providers_send_them() {
        let cases: &[(&str, Option<u64>)] = &[
            // The shapes providers send.
            ("6m0s", Some(360_000)),
            ("1m30.5s", Some(90_500)),
            ("1.5s", Some(1_500)),
            ("13ms", Some(13)),
            ("2m", Some(120_000)),
            ("1h2m3s", Some(3_723_000)),
            ("0s", Some(0)),
            ("1.146s", Some(1_146)),
            ("12ms", Some(12)),
            // Bare numbers are seconds.
            ("20", Some(20_000)),
            ("1.5", Some(1_500)),
            ("0", Some(0)),
            (".5", Some(500)),
            ("1.", Some(1_000)),
            // Small units.
            ("1500us", Some(2)),
            ("1000µs", Some(1)),
            ("1000μs", Some(1)),
            ("1000000ns", Some(1)),
            ("1h0.5m", Some(3_630_000)),
            ("1s1s", Some(2_000)),
            // Whitespace around the value is trimmed.
            ("  7s\t", Some(7_000)),
            (" 20 ", Some(20_000)),
        ];
        for &(input, want) in cases {
            assert_eq!(parse_duration_ms(input), want, "parse_duration_ms({input:?})");
        }
    }

    #[test]
    fn fractions_of_a_millisecond_round_up_never_down() {
        let cases: &[(&str, u64)] = &[
            ("1ns", 1),
            ("0.1ms", 1),
            ("1.0001ms", 2),
            ("1.0000001s", 1_001),
            ("999999ns", 1),
            ("1000001ns", 2),
            ("0.0000001", 1),
            ("1.9999ms", 2),
            ("2.000ms", 2),
            // Beyond the exact digits, a non-zero tail still rounds up...
            ("1.00000000000000000001s", 1_001),
            // ...and a zero tail does not.
            ("1.00000000000000000000s", 1_000),
            ("0.5us", 1),
        ];
        for &(input, want) in cases {
            assert_eq!(parse_duration_ms(input), Some(want), "parse_duration_ms({input:?})");
        }
    }

    #[test]
    fn anything_else_is_none() {
        let cases = [
            "",
            "   ",
            "-1s",
            "-1",
            "+1s",
            "+1",
            "NaN",
            "nan",
            "inf",
            "Infinity",
            "1e3",
            "1E3s",
            "s",
            "ms",
            ".",
            ".s",
            "1 s",
            "1m 30s",
            "1d",
            "1w",
            "1S",
            "1sec",
            "1x",
            "abc",
            "1.2.3s",
            "1..2s",
            "0x10",
            "6m0s,",
            "1,5s",
            "１s",
            "1µ",
            "99999999999999999999999999999999999999999999h",
            "18446744073709551616ms", // u64::MAX + 1
        ];
        for input in cases {
            assert_eq!(parse_duration_ms(input), None, "parse_duration_ms({input:?})");
        }
    }

    #[test]
    fn the_largest_u64_fits_and_one_more_does_not() {
        assert_eq!(parse_duration_ms("18446744073709551615ms"), Some(u64::MAX));
        assert_eq!(parse_duration_ms("18446744073709551615.5ms"), None);
    }

    #[test]
    fn resets_are_durations_or_rfc3339_instants() {
        let cases: &[(&str, Option<u64>)] = &[
            ("6m0s", Some(360_000)),
            ("20", Some(20_000)),
            // Anthropic: an RFC 3339 instant, in ms from now.
            ("2026-11-30T10:00:05Z", Some(5_000)),
            ("2026-11-30T10:00:05.120Z", Some(5_120)),
            // A fraction of a ms still in the future is a whole ms.
            ("2026-11-30T10:00:00.000001Z", Some(1)),
            ("2026-11-30T11:00:05+01:00", Some(5_000)),
            ("2026-11-30T09:02:00-00:59", Some(60_000)),
            // Past (or now): the window is open.
            ("2026-11-30T10:00:00Z", Some(0)),
            ("2026-11-30T09:59:59Z", Some(0)),
            ("2020-01-01T00:00:00Z", Some(0)),
            // Neither shape.
            ("2026-11-30", None),
            ("2026-11-30T10:00:05", None),
            ("tomorrow", None),
            ("", None),
        ];
        for &(input, want) in cases {
            assert_eq!(parse_reset_ms(input, NOW), want, "parse_reset_ms({input:?})");
        }
    }

    #[test]
    fn retry_after_is_seconds_or_an_http_date() {
        let cases: &[(&str, Option<u64>)] = &[
            ("20", Some(20_000)),
            ("0", Some(0)),
            ("1.5", Some(1_500)),
            ("0.0001", Some(1)),
            (" 55 ", Some(55_000)),
            // IMF-fixdate, RFC 850 and asctime.
            ("Mon, 30 Nov 2026 10:00:07 GMT", Some(7_000)),
            ("Monday, 30-Nov-26 10:01:00 GMT", Some(60_000)),
            ("Mon Nov 30 10:00:30 2026", Some(30_000)),
            // A date already past: retry now.
            ("Mon, 30 Nov 2026 09:00:00 GMT", Some(0)),
            // Azure's -1 means "no advice", and negatives are never a delay.
            ("-1", None),
            ("-0.5", None),
            // Not a Retry-After shape (Go durations belong to the reset headers).
            ("20s", None),
            ("soon", None),
            ("", None),
            ("NaN", None),
        ];
        for &(input, want) in cases {
            assert_eq!(parse_retry_after_ms(input, NOW), want, "parse_retry_after_ms({input:?})");
        }
    }

    #[test]
    fn millis_are_plain_non_negative_numbers() {
        let cases: &[(&str, Option<u64>)] = &[
            ("1500", Some(1_500)),
            ("0", Some(0)),
            ("1500.5", Some(1_501)),
            (" 12 ", Some(12)),
            ("-1", None),
            ("1500ms", None),
            ("", None),
            ("x", None),
        ];
        for &(input, want) in cases {
            assert_eq!(parse_millis(input), want, "parse_millis({input:?})");
        }
    }

    proptest! {
        #[test]
        fn parsers_never_panic(s in ".*", now in any::<i64>()) {
            let _ = parse_duration_ms(&s);
            let _ = parse_reset_ms(&s, now);
            let _ = parse_retry_after_ms(&s, now);
            let _ = parse_millis(&s);
        }

        #[test]
        fn duration_shaped_garbage_never_panics(s in "[0-9.µμunsmh+-]{0,40}") {
            let _ = parse_duration_ms(&s);
        }

        /// h/m/s/ms compose exactly like arithmetic says.
        #[test]
        fn composite_durations_add_up(h in 0u64..1_000, m in 0u64..60, s in 0u64..60, ms in 0u64..1_000) {
            let text = format!("{h}h{m}m{s}s{ms}ms");
            prop_assert_eq!(parse_duration_ms(&text), Some(((h * 60 + m) * 60 + s) * 1000 + ms));
        }

        /// `whole.frac` seconds is never shorter than its exact value, and less
        /// than 1 ms longer.
        #[test]
        fn decimal_seconds_round_up_by_less_than_a_ms(whole in 0u64..100_000, frac in "[0-9]{1,12}") {
            let exact_ns: u128 = u128::from(whole) * 1_000_000_000
                + frac.parse::<u128>().unwrap() * 10u128.pow(9) / 10u128.pow(frac.len() as u32);
            let got = u128::from(parse_duration_ms(&format!("{whole}.{frac}s")).unwrap());
            prop_assert!(got * 1_000_000 >= exact_ns, "{got} ms < {exact_ns} ns");
            prop_assert!(got * 1_000_000 < exact_ns + 1_000_000, "{got} ms rounds up too far from {exact_ns} ns");
        }

        /// An RFC 3339 instant `d` ms ahead reads back as `d` (0 when behind).
        #[test]
        fn rfc3339_round_trips(offset_ms in -10_000_000i64..10_000_000) {
            let at = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(NOW + offset_ms) * 1_000_000).unwrap();
            let text = at.format(&time::format_description::well_known::Rfc3339).unwrap();
            prop_assert_eq!(parse_reset_ms(&text, NOW), Some(offset_ms.max(0) as u64));
        }

        /// An HTTP date `d` seconds ahead reads back as `d × 1000` (0 when behind).
        #[test]
        fn http_date_round_trips(offset_s in -1_000_000i64..1_000_000) {
            let at = UNIX_EPOCH + std::time::Duration::from_millis((NOW + offset_s * 1000) as u64);
            let text = httpdate::fmt_http_date(at);
            prop_assert_eq!(parse_retry_after_ms(&text, NOW), Some((offset_s.max(0) * 1000) as u64));
        }
    }
}
