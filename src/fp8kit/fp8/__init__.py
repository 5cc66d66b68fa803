"""FP8 numerics and decisions: sites, static rules, policies, recipes, conversion through torchao."""
