"""SWE-style evaluation and the `swe` environment.

    instance.py   SweInstance (SWE-bench fields + offline source), Prediction, loaders
    snapshot.py   a repository snapshot whose single commit hash depends on the content only (stdlib; runs in images)
    images.py     image tiers: base -> environment (wheels) -> instance (/opt/repo at base_commit), hashed and cached
    script.py     the evaluation script and the bundle that carries it into a sandbox
    grading.py    pure: log text -> per-test status -> FAIL_TO_PASS / PASS_TO_PASS -> report
    patches.py    unified diffs: make one, check one
    evaluate.py   the harness on the fleet: run_evaluation, Evaluator, evaluate_in_sandbox
    report.py     the run folder and the summary
    validate.py   gold k of k, empty none, flaky tests quarantined
    env.py        SweEnv, the RL environment (entry point `swe`)
    builder/      the SWE-smith-style dataset builder (pins, mutate, problem statements, build)
    cli.py        swe-eval, swe-validate, swe-build
    data/         the shipped dataset (instances.jsonl) and the pinned projects (projects.json)

Nothing heavy is imported here: orchestrator/cli.py imports `environments.swe.cli` to build its parser.
"""
