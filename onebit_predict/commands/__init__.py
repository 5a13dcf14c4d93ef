"""The console scripts, one module per command: argument parsing and printing only.

Every command goes through :func:`onebit_predict.commands.common.run_command`, which maps
exceptions to exit codes (0 ok, 1 check failed, 2 usage or input error) and logs to stderr.
No module outside this package imports argparse.
"""
