"""What the evaluations share: the probe head and its hand-written step (`probe_head`), the
evaluation over depth and its tables (`over_depth`), the metric names (`metric_names`) and the
isolated evaluation mode (`eval_mode`)."""
