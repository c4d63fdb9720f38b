"""gradwatch: verify backprop gradients during training.

Example:
    >>> import gradwatch
    >>> gradwatch.rel_diff([1.0], [1.0])
    0.0
"""

from gradwatch._version import __version__
from gradwatch.bands import Verdict
from gradwatch.check.backward import check_backward
from gradwatch.check.higher_order.double_backward import check_double_backward
from gradwatch.check.independence.check import IndependenceReport, check_independence
from gradwatch.check.judging.report import CheckReport, TensorCheck, TrainingCheck
from gradwatch.check.model import check_model, check_numpy
from gradwatch.check.numerics.differences import max_rel_error, numerical_grad, rel_diff
from gradwatch.config import GradWatchConfig, load_config
from gradwatch.errors import ConfigError, GradientCheckError, GradientDriftError, GradWatchError
from gradwatch.options import CheckOptions
from gradwatch.watch.gradwatch import GradWatch
from gradwatch.watch.trend import Alert, TrendTracker

__all__ = [
    "Alert",
    "CheckOptions",
    "CheckReport",
    "ConfigError",
    "GradWatch",
    "GradWatchConfig",
    "GradWatchError",
    "GradientCheckError",
    "GradientDriftError",
    "IndependenceReport",
    "TensorCheck",
    "TrainingCheck",
    "TrendTracker",
    "Verdict",
    "__version__",
    "check_backward",
    "check_double_backward",
    "check_independence",
    "check_model",
    "check_numpy",
    "load_config",
    "max_rel_error",
    "numerical_grad",
    "rel_diff",
]
