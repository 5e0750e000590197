"""The configuration layer, under every face (cli/, api/, serve/): the options, their types,
ranges and defaults (flags.py's table and DEFAULTS, validate.py; no argparse: cli/parser.py builds
the command line from the table), YAML configs and hardware files resolved into the engine's Policy
and EngineConfig (options.py), the checks made before anything loads (preflight.py) and prompt
loading (prompts.py). It imports nothing above the engine."""
