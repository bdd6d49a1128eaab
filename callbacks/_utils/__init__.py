"""Internal helpers of the callbacks: collectives (`distributed`) and feature passes
(`feature_collection`). Not a public API."""
