"""The update: what training does between ``.grad`` and the weights (clipping, the optimizer's step), judged on sampled
coordinates. Pure math: :mod:`clipping` (one factor for every tensor, one threshold at every clipped step) and
:mod:`optimizer_replay` (torch's own optimizers' step replayed in float64)."""
