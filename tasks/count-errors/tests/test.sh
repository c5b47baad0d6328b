#!/bin/bash
# 1 when $EXPECTED_FILE (task.toml's [verifier].env) holds the count of ERROR lines, else 0
expected=$(cat /app/logs/*.log | grep -c 'ERROR')
got=$(tr -d ' \n' < "$EXPECTED_FILE" 2>/dev/null)
if [ "$got" = "$expected" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
echo "expected $expected, got '$got'"
