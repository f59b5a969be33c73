"""QSA Workbench: Triton kernels for QSA sparse attention and the workbench that measures them."""
