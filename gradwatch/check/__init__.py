"""The math and one check: numeric differences, sampling, the objective and its isolation, judging, the report."""
