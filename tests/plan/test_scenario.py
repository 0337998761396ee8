from moemesh.shared.plan.scenario import run_seed, with_overrides


def test_seed_findings_hold_under_the_stated_assumptions():
    r = run_seed(with_overrides())
    failed = {k: v["value"] for k, v in r["checks"].items() if not v["holds"]}
    assert not failed, failed
    assert r["assumptions"] and r["all_hold"]
