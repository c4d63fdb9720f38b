"""Watching a training run: the GradWatch facade, its schedule, trends (where alerts are decided), ranks."""
