"""The ``kvd`` command line."""
