"""A package outside WanDistiller adding one option of each kind, each one module + one YAML and nothing else
(`WANDISTILLER_PLUGINS=dummyplugin`): what tests/core/test_plugins.py shows the project picks up."""
