"""The foundation: errors, enums, the clock, backoff, locks, secrets, compact token forms."""
