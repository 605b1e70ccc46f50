"""scikit-learn's digits with a small CNN whose BatchNorm is synchronised over devices."""
