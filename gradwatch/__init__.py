"""gradwatch: verify backprop gradients during training.

Example:
    >>> import gradwatch
    >>> gradwatch.rel_diff([1.0], [1.0])
    0.0
"""

from .backward import check_backward
from .check import check_model, check_numpy
from .errors import ConfigError, GradientCheckError, GradientDriftError, GradWatchError
from .numeric import Verdict, max_rel_error, numerical_grad, rel_diff
from .options import CheckOptions
from .report import CheckReport, TensorCheck

__version__ = "0.1.0"

__all__ = [
    "CheckOptions",
    "CheckReport",
    "ConfigError",
    "GradWatchError",
    "GradientCheckError",
    "GradientDriftError",
    "TensorCheck",
    "Verdict",
    "check_backward",
    "check_model",
    "check_numpy",
    "max_rel_error",
    "numerical_grad",
    "rel_diff",
]
