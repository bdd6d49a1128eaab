"""Callbacks that change how a network trains: ResidualDroppath, EMA of the weights and
`torch.compile` of the residual blocks."""
