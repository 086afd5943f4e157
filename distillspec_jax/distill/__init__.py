"""What the draft learns from: divergences (FKL, RKL, JSD, TVD), AdaSPEC token selection, the DistillSpec objectives (data sources, recipes) and the offline teacher cache."""
