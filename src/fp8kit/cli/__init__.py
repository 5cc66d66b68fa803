"""The command line: ``fp8kit train | compare | plan | bench-layers | merge-policy | export | config-docs``."""
