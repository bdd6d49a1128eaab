"""Internal helpers of the callbacks: collectives (`distributed`), feature passes
(`feature_collection`, `feature_replay`) and the probe heads
stacked by width (`stacked_heads`, `online_probe_heads`). Not a public API."""
