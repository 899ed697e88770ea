"""Fixed word lists the synthetic tokenizer corpus is drawn from.

Pure data. The lists (their content and order) are hashed into the tiny tokenizer recipe, so
editing any of them changes the cache key and rebuilds every cached tiny tokenizer and model.
"""

from __future__ import annotations


def _words(text: str) -> list[str]:
    return text.split()


_FUNCTION_WORDS = _words("""the a an this that these those some any each every no all both either
neither one two three few many much more most other another such what which who whom whose
where when why how and or but so yet for nor if then else than because although though while
unless until since after before once as to of in on at by with from into onto over under about
above below between through during without within along across behind beyond near around up
down out off again further here there now just also only very too quite rather almost already
still even ever never always often sometimes usually not I you he she it we they me him her us
them my your his its our their mine yours ours theirs myself yourself itself ourselves
themselves is are was were be been being am have has had having do does did doing will would
shall should can could may might must let lets it's don't doesn't didn't isn't aren't wasn't
can't won't I'm you're we're they're that's there's here's let's I've we've you'll we'll""")

_NOUNS = _words("""time year people way day man woman child world life hand part place case week
company system program question work government number night point home water room mother
area money story fact month lot right study book eye job word business issue side kind head
house service friend father power hour game line end member law car city community name
president team minute idea kid body information back parent face others level office door
health person art war history party result change morning reason research girl guy moment air
teacher force education foot boy age policy process music market sense nation plan college
interest death experience effect use class control care field development role effort rate
heart drug show leader light voice wife police mind price report decision son view
relationship town road arm difference value building action model season society tax director
position player record paper space ground form event official matter center couple site
project activity star table need court oil situation cost industry figure street image phone
data picture practice piece land product doctor wall patient worker news test movie north love
support technology step baby computer type attention film tree source organization hair window
evidence population site file folder directory path error bug fix feature request response
server client user password token key value list array string number object function method
class module package library framework version release branch commit merge build deploy test
suite case assertion output input stream buffer queue cache memory disk network socket port
address host container image volume job task worker thread process signal message event log
metric trace span database table column row index query schema record field type struct
interface protocol handler callback promise future result option config setting parameter
argument flag variable constant expression statement loop condition exception stack frame
heap pointer reference byte bit character line word page chapter section paragraph document
note comment issue ticket review change patch diff status state step stage pipeline model
tokenizer dataset batch epoch gradient loss reward policy agent environment tool call harness
sandbox proxy engine learner rollout sample trajectory episode prompt completion context
window weight checkpoint""")

_VERBS = _words("""be have do say go get make know think take see come want look use find give tell
work call try ask need feel become leave put mean keep let begin seem help talk turn start show
hear play run move like live believe hold bring happen write provide sit stand lose pay meet
include continue set learn change lead understand watch follow stop create speak read allow
add spend grow open walk win offer remember love consider appear buy wait serve die send
expect build stay fall cut reach kill remain suggest raise pass sell require report decide
pull return explain hope develop carry break receive agree support hit produce eat cover catch
draw choose install update upgrade configure compile parse load save store fetch push pull
merge rebase deploy restart stop kill check verify validate test debug trace log print format
render encode decode serialize convert compute measure count sort filter map reduce split join
replace remove delete insert append extend clear reset flush sync wrap handle raise throw retry
schedule launch spawn connect listen bind accept close read write open seek copy move rename
create edit patch apply revert commit clone search match resolve import export define declare
assign return yield await generate sample train evaluate""")

_ADJECTIVES = _words("""good new first last long great little own other old right big high different
small large next early young important few public bad same able local sure free better true
whole real best full special easy clear recent certain personal open red difficult available
likely short single medical current wrong private past foreign fine common poor natural
significant similar hot dead central happy serious ready simple left physical general
environmental financial blue democratic dark various entire close legal religious cold final
main green nice huge popular traditional cultural empty invalid valid missing default optional
required internal external remote unknown fast slow safe unsafe stable broken temporary
permanent global static dynamic async synchronous parallel sequential random deterministic
binary numeric empty nested raw clean dirty active idle pending running failed successful
complete partial tiny quick lazy bright quiet careful strange useful""")

_ADVERBS = _words("""quickly slowly carefully really probably actually finally simply exactly
directly clearly easily recently currently usually generally certainly suddenly immediately
quietly correctly properly automatically manually eventually fortunately unfortunately
together instead otherwise therefore however meanwhile""")

_NAMES = _words("""Alice Bob Carol David Emma Frank Grace Henry Isabel Jack Karen Liam Maria Noah
Olivia Paul Quinn Rachel Sam Tina Uma Victor Wendy Xavier Yara Zoe Smith Johnson Williams Brown
Jones Garcia Miller Davis Martinez Lee Chen Wang Kim Patel London Paris Berlin Tokyo Boston
Seattle Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April
June July August September October November December Python Linux GitHub JSON HTTP API URL CPU
GPU Docker Kubernetes Ubuntu""")

_EXTS = _words("py js ts json md txt csv yaml yml toml sh cfg ini log rs go c h cpp html css sql")
_DIRS = _words("""src lib tests test docs bin scripts config data tmp build dist app core utils common
api models services cmd internal pkg examples assets static templates home user var etc usr
local share opt work repo project""")
_SHELL_CMDS = [
    "ls -la {d}",
    "cd {d}",
    "cat {f}",
    "head -n {n} {f}",
    "tail -f {f}",
    'grep -rn "{w}" {d}',
    'find {d} -name "*.{e}"',
    "mkdir -p {d}",
    "rm -rf {d}",
    "cp {f} {f2}",
    "mv {f} {f2}",
    "python {f} --{w} {n}",
    "python -m pytest {d} -q",
    "pip install {w}",
    "git status",
    "git diff {f}",
    'git add {f} && git commit -m "{s}"',
    "git log --oneline -n {n}",
    "git checkout -b {w}-{w2}",
    'echo "{s}" > {f}',
    "wc -l {f}",
    "sed -i 's/{w}/{w2}/g' {f}",
    "curl -s http://localhost:{p}/{w}",
    "docker run --rm -it {w}:{n}",
    "make {w}",
    "npm install {w}",
    "chmod +x {f}",
    "export {W}={n}",
    "tar -xzf {w}.tar.gz",
    "ps aux | grep {w}",
    "du -sh {d}",
]
_KEYS = _words("""id name type value status message error code data result items count total
path file content text title description created_at updated_at user_id email version
enabled timeout retries limit offset page size tags labels metadata config options url
method headers body query role model temperature max_tokens tool arguments command input
output stdout stderr exit_code duration score reward""")
