"""Internal helpers of the callbacks: collectives (`distributed`), feature passes
(`feature_collection`, `feature_replay`) and the probe heads' joint step
(`probe_heads_together`). Not a public API."""
