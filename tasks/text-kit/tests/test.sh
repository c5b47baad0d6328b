#!/bin/bash
# partial credit: the fraction of textkit's four functions that pass their checks, in reward.json
python3 /tests/grade.py > /logs/verifier/reward.json
cat /logs/verifier/reward.json
