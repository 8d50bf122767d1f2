"""What every worker actor has, prefill or decode: the actor base over an engine (`actor`), the
typed task it receives (`task`), what it reports (`info`), its errors and metrics."""
