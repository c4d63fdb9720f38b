"""gradwatch: verify backprop gradients during training.

Example:
    >>> import gradwatch
    >>> gradwatch.rel_diff([1.0], [1.0])
    0.0
"""

from ._version import __version__
from .check.backward import check_backward
from .check.double_backward import check_double_backward
from .check.independence import IndependenceReport, check_independence
from .check.model import check_model, check_numpy
from .check.numeric import Verdict, max_rel_error, numerical_grad, rel_diff
from .check.report import CheckReport, TensorCheck, TrainingCheck
from .config import GradWatchConfig, load_config
from .errors import ConfigError, GradientCheckError, GradientDriftError, GradWatchError
from .options import CheckOptions
from .watch.gradwatch import GradWatch
from .watch.trend import Alert, TrendTracker

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
