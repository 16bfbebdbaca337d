set -u
source <(sed -n '/^setup_env()/,/^}/p' benchmarks/gpu.sh)
setup_env > /dev/null
out=$OUT/diag; mkdir -p $out
( sleep 80; pkill -ABRT -f "parallel.worker" ) &
PYTHONFAULTHANDLER=1 PDSERVE_TEST_LIMIT_S=90 timeout -k 5 110 python3 -m pytest -x -s -v -p no:cacheprovider \
  "tests/test_gpu_tp.py::test_tp2_gives_the_single_gpu_tokens_in_fp32_on_the_trained_model" > $out/t1.log 2>&1
echo "t1 exit $?" | tee -a $out/env.txt
grep -v "^\s*$" $out/t1.log | grep -v "Extension modules" | cut -c1-200 | tail -80
