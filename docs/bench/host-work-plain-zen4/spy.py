import sys
from collections import Counter
path, marker = sys.argv[1], sys.argv[2]
leaf=Counter(); tot=0; fr=Counter()
for line in open(path):
    stack, _, n = line.rstrip().rpartition(' ')
    if marker not in stack: continue
    n=int(n); tot+=n
    frames=stack.split(';')
    leaf[frames[-1]]+=n
    for f in set(frames): fr[f]+=n
print('total',tot)
for k,v in leaf.most_common(30): print(f"{100*v/tot:5.1f}% {k[:140]}")
print('--- inclusive')
for k,v in fr.most_common(60): print(f"{100*v/tot:5.1f}% {k[:140]}")
