"""Dataset loading (:mod:`opd.data.datasets`) and conversion to opd's chat format (:mod:`opd.data.converters`).

Nothing is re-exported here: ``python -m opd.data.converters`` imports this package first, and runpy warns
when the package already imported the module it runs.
"""
