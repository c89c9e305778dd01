printf 'hello, sandbox\n' > greeting.txt && mkdir -p out && : > out/done
