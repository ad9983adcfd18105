"""Harbor / Terminal-Bench task directories as envfleet environments.

task.py       load_task (task.toml via tomllib, instruction.md, environment/, solution/, tests/), parse_reward
env.py        HarborEnvironment: image = the task's Dockerfile + a writable-paths tail; score runs tests/test.sh
validate.py   oracle must pass, an empty solution must fail
installed.py  `environments.harbor.installed:NAME`: an imported environment as a config reference
archive.py    pack (client) and HarborKind (entry point envfleet.archive_kinds): the tasks uploaded to a server
cli.py        `envfleet envs import-harbor DIR... --name NAME [--server HOST:PORT]`
"""
