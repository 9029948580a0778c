"""What graphmend runs: targets named on the command line (files, the demo,
the zoo) and the models they build."""
