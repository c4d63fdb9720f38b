"""What one check covers: units, pieces (row slices), the cycle of K checks, and the coverage so far.

Planning apart from doing: this package decides, :mod:`gradwatch.check` runs. Used alike by one
process and (next) by ranks.
"""
