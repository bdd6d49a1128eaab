"""Callbacks that keep a run trustworthy: exact resume, the divergence guard, pre-emption and
lost-rank handling, and the records and clean-up around a fit."""
