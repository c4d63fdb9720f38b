"""Higher-order checks: ``check_double_backward`` and the inner derivatives of each leaf module.
"""
