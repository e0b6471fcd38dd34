//! Parsing the durations and instants providers put in rate-limit headers.
