#!/usr/bin/env bash
# Mutation testing of the privacy core: plant every small bug mutmut can make in the modules a privacy bug
# would hide in, run the fast tests that cover each, and list the mutants no test catches.
#
#   bash scripts/mutation.sh                 # every target below (the documented run; see the report for its time)
#   bash scripts/mutation.sh bounds noise    # some targets only (one at a time while developing)
#   MUTANTS="dpml.audit.bounds.x_gdp_delta__mutmut_*" bash scripts/mutation.sh bounds   # only these mutants
#
# Targets (module → the mutants run → the tests that judge them):
#   bounds       dpml/audit/bounds.py, all                         tests/test_bounds.py
#   noise        dpml/train/noise.py, all                          tests/test_noise.py (no subprocess test),
#                                                                  tests/test_dpsgd.py (the trainer's noise streams)
#   clip         dpml/train/clipping.py, clip_factors only         tests/test_dpsgd.py, tests/test_clipping_property.py
#   checks       dpml/audit/checks.py, all                         tests/test_conformance.py (the unit tests of the
#                                                                  checks' statistics, not the training ones)
#   accountants  dpml/accounting/accountants.py, supports.py, all  tests/test_accounting.py (fast part),
#                                                                  tests/test_accountant_registry.py
#   precision    dpml/train/probe_precision.py, all                tests/test_probe_precision.py (the float64 check's
#                                                                  tolerance: too loose a one would pass a wrong rule)
#   matrix_exp   dpml/train/rules/matrix_exp.py, all               tests/test_matrix_exp_rule.py
#   ledger       the ledger's reservation, composition, budget      tests/test_ledger.py, tests/test_unit_ledger.py,
#                checks, views and spend lifecycle (dpml/ledger/:   tests/test_spending.py, test_kl_certificate.py,
#                ledger.py, views.py, unit_accounts.py,             test_lineage_by_records.py, test_ledger_views.py
#                budget_checks.py, spending.py)                     (SQLite, no race, no pipeline run: its
#                                                                  76 s would run for every surviving mutant)
#
# It works on a copy of the working tree (build/mutation, or $MUTATION_DIR), never on the checkout: mutmut
# writes its mutants beside the copy. mutmut is installed into the project's virtual environment when
# missing (pinned below). Each surviving mutant is printed with its diff and written to
# build/mutation/survivors.txt; the committed report, benchmarks/results/mutation.md, says for each
# survivor of the last full run which test now kills it or why it is equivalent.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON="$ROOT/.venv/bin/python"
MUTMUT_VERSION=3.8.1
if [ "$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("mutmut"))' 2>/dev/null)" != "$MUTMUT_VERSION" ]; then
  "$PYTHON" -m pip install -q "mutmut==$MUTMUT_VERSION"
fi

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(bounds noise clip checks accountants precision matrix_exp ledger)

files=() tests=() patterns=() deselect=()
for target in "${targets[@]}"; do
  case "$target" in
    bounds) files+=(dpml/audit/bounds.py); tests+=(tests/test_bounds.py); patterns+=("dpml.audit.bounds.*") ;;
    noise) files+=(dpml/train/noise.py); tests+=(tests/test_noise.py tests/test_dpsgd.py); patterns+=("dpml.train.noise.*")
           deselect+=("not any_number_of_threads") ;;
    clip) files+=(dpml/train/clipping.py); tests+=(tests/test_dpsgd.py tests/test_clipping_property.py)
          patterns+=("dpml.train.clipping.x_clip_factors__mutmut_*") ;;
    checks) files+=(dpml/audit/checks.py); tests+=(tests/test_conformance.py); patterns+=("dpml.audit.checks.*")
            deselect+=("not broken_trainer and not intact_trainer and not the_gate_fails and not across_seeds") ;;
    accountants) files+=(dpml/accounting/accountants.py dpml/accounting/supports.py)
                 tests+=(tests/test_accounting.py tests/test_accountant_registry.py)
                 patterns+=("dpml.accounting.accountants.*" "dpml.accounting.supports.*") ;;
    precision) files+=(dpml/train/probe_precision.py); tests+=(tests/test_probe_precision.py)
               patterns+=("dpml.train.probe_precision.*") ;;
    matrix_exp) files+=(dpml/train/rules/matrix_exp.py); tests+=(tests/test_matrix_exp_rule.py)
                patterns+=("dpml.train.rules.matrix_exp.*") ;;
    ledger) files+=(dpml/ledger/ledger.py dpml/ledger/views.py dpml/ledger/unit_accounts.py
                    dpml/ledger/budget_checks.py dpml/ledger/spending.py)
            tests+=(tests/test_ledger.py tests/test_unit_ledger.py tests/test_spending.py tests/test_kl_certificate.py
                    tests/test_lineage_by_records.py tests/test_ledger_views.py)
            for method in reserve cancel record_event _standing_of_run _lineage_standing _filter_order; do
              patterns+=("dpml.ledger.ledger.xǁLedgerǁ${method}__mutmut_*")
            done
            for method in person total kl_total unit_epsilons _releases; do
              patterns+=("dpml.ledger.views.xǁLedgerViewsǁ${method}__mutmut_*")
            done
            patterns+=("dpml.ledger.unit_accounts.*" "dpml.ledger.budget_checks.*" "dpml.ledger.spending.*")
            deselect+=("not racing and not postgresql and not three_names_and_encodings and not weekly_export and not pipeline") ;;
    *) echo "unknown target '$target' (bounds, noise, clip, checks, accountants, precision, matrix_exp, ledger)" >&2; exit 2 ;;
  esac
done

WORK="${MUTATION_DIR:-$ROOT/build/mutation}"
rm -rf "$WORK"
mkdir -p "$WORK"
cp -r dpml tests configs examples docs params.yaml pyproject.toml README.md "$WORK/"
find "$WORK" -name __pycache__ -prune -exec rm -rf {} +

toml_list() { local out="" item; for item in "$@"; do out+="\"$item\", "; done; echo "[${out%, }]"; }
select="" # test names left out (-k), e.g. the ones that run the code in a subprocess, which mutmut cannot see
for expression in "${deselect[@]}"; do select+="${select:+ and }($expression)"; done
by_name=""
[ -z "$select" ] || by_name=", \"-k\", \"$select\""
cat >> "$WORK/pyproject.toml" <<EOF

[tool.mutmut]
source_paths = ["dpml"]
only_mutate = $(toml_list "${files[@]}")
pytest_add_cli_args_test_selection = $(toml_list "${tests[@]}")
pytest_add_cli_args = ["-p", "no:cacheprovider", "-x", "-q", "-m", "not slow and not exhaustive"$by_name]
process_isolation = "forkserver"
also_copy = ["examples", "docs", "params.yaml", "README.md", "configs"]
use_git_change_detection = false
EOF

cd "$WORK"
start=$(date +%s)
status=0
[ -z "${MUTANTS:-}" ] || read -r -a patterns <<< "$MUTANTS"
"$ROOT/.venv/bin/mutmut" run --max-children "${MUTATION_CHILDREN:-2}" "${patterns[@]}" || status=$?
seconds=$(( $(date +%s) - start ))
"$ROOT/.venv/bin/mutmut" results > results.txt || true
grep -E ": (survived|no tests|timeout|suspicious)" results.txt > survivors.txt || true
echo "mutation run: targets ${targets[*]}, $(wc -l < survivors.txt) not killed, ${seconds} s"
while read -r line; do
  name="${line%%:*}"
  "$ROOT/.venv/bin/mutmut" show "$name" || true
done < survivors.txt
exit "$status"
