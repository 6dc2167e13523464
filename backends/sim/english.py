"""Common English and technical words that the simulator's tokenizer keeps as one token each.

Chat roles, function words and the vocabulary of ordinary demo prompts about LLM serving.
Lowercase ASCII letters only (the tokenizer lowercases its input). Words outside this list
still tokenize, as several sub-word pieces (see ``backends.sim.tokenizer``).
"""

from __future__ import annotations

_WORDS = """
system user assistant tool tools developer function functions role content name arguments
the a an and or but not no nor so yet if then else than that this these those there here
i me my mine myself you your yours yourself we us our ours ourselves he him his himself she
her hers herself it its itself they them their theirs themselves one ones someone something
anyone anything everyone everything nobody nothing somebody anybody everybody who whom whose
what which when where why how whatever whenever wherever however whether
is are was were be been being am have has had having do does did done doing will would shall
should can could may might must ought need needs needed dare
to of in on at by for from with without within into onto upon about above below under over
after before between among through during against around across along behind beyond near
off out up down since until till toward towards via per like unlike despite except inside
outside onto throughout beside besides
all any both each either every few many more most much neither none other others own same
several some such enough less least little lot lots only just also too very really quite
rather almost already always never often sometimes usually again ever still even once twice
now today tomorrow yesterday soon later early late ago yes ok okay please thanks thank hello
hi hey goodbye bye sorry welcome dear
first second third last next previous new old good better best bad worse worst great small
large big long short high low right left wrong true false full empty open closed free busy
fast slow quick easy hard simple complex clear real main major minor common rare same
different possible important available able unable certain sure likely whole single double
half general specific special public private local global final initial current recent
modern total average maximum minimum higher lower larger smaller longer shorter faster
slower cheaper expensive cheap safe secure ready healthy warm cold hot hit miss hits misses
make makes made making take takes took taken taking give gives gave given giving get gets got
gotten getting go goes went gone going come comes came coming see sees saw seen seeing know
knows knew known knowing think thinks thought thinking say says said saying tell tells told
telling ask asks asked asking use uses used using find finds found finding want wants wanted
try tries tried trying call calls called calling work works worked working seem seems seemed
feel feels felt leave leaves left keep keeps kept keeping let lets begin begins began begun
start starts started starting stop stops stopped stopping show shows showed shown hear heard
play run runs ran running move moves moved live lives lived believe bring brings brought
happen happens happened write writes wrote written writing read reads reading sit stand lose
lost pay paid meet met include includes included including continue continues continued set
sets setting learn learned change changes changed changing lead leads understand understood
watch follow follows followed create creates created creating speak spoke spend spent grow
grows grew open opens opened walk win wins won offer offers offered remember love consider
appear appears buy wait waits waited waiting serve serves served serving die send sends sent
sending expect expects build builds built building stay fall cut reach reaches kill remain
remains suggest raise pass passes passed sell require requires required report reports
decide decides pull return returns returned returning explain explains explained describe
describes compare compares compared compute computes computed computing measure measures
measured measuring store stores stored storing remove removes removed removing evict evicts
evicted eviction route routes routed routing send receive receives received load loads loaded
loading save saves saved check checks checked checking test tests tested testing fix fixes
fixed add adds added adding update updates updated updating delete deletes deleted list lists
listed sort sorted count counts counted match matches matched matching reuse reused share
shares shared sharing schedule schedules scheduled scheduling queue queues queued queueing
batch batches batched batching stream streams streamed streaming generate generates generated
generating answer answers answered summarize summary translate write rewrite improve improved
help helps helped helping support supports supported allow allows allowed prefer choose chose
chosen pick picks picked balance balanced scale scales scaled scaling restart restarts
restarted fail fails failed failing failure failures retry retries recover recovered drop
drops dropped delay delays delayed refuse refused reset resets
time times year years day days week weeks month months hour hours minute minutes second
seconds moment way ways thing things man men woman women child children people person
world life hand hands part parts place places case cases point points group groups problem
problems fact facts eye eyes number numbers night home room mother father area areas money
story stories word words line lines book books job jobs business issue issues side sides kind
kinds head house service services friend friends power hour game games end member members law
car city cities community country countries name names team teams minute idea ideas body
information back parent face level levels office door health art war history party result
results morning reason reasons research girl boy guy food water air land form forms example
examples question questions answer step steps order orders price prices cost costs value
values rate rates size sizes type types state states process processes model models data
system systems program programs problem language languages text texts code codes file files
page pages message messages request requests response responses user users client clients
server servers machine machines computer computers network networks memory disk cpu gpu gpus
cpus core cores node nodes cluster clusters replica replicas worker workers engine engines
router routers gateway gateways proxy backend backends frontend api apis endpoint endpoints
port ports host hosts address url http https json yaml python rust go java javascript sql
cache caches cached caching prefix prefixes suffix block blocks token tokens tokenizer
tokenize tokenized key keys hash hashes hashing index indexes indices event events metric
metrics log logs trace traces benchmark benchmarks latency latencies throughput bandwidth
capacity utilization usage load loads policy policies score scores scoring cost overlap
session sessions conversation conversations chat chats prompt prompts completion completions
context contexts window windows attention layer layers weight weights parameter parameters
training inference prefill decode decoding kv llm llms ai agent agents agentic tool model
vllm sglang dynamo kubernetes docker cloud deployment deployments production demo demos
simulation simulator simulated benchmark hardware software open source license
error errors warning warnings success status health healthy timeout timeouts tail median
percentile average mean p50 p90 p99 ms second ttft tpot itt
one two three four five six seven eight nine ten eleven twelve twenty thirty forty fifty
hundred thousand million billion zero once
january february march april may june july august september october november december
monday tuesday wednesday thursday friday saturday sunday
red blue green yellow black white gray grey orange purple brown pink
north south east west up down left right top bottom front back middle center
science math mathematics physics chemistry biology economics music movie movies song songs
school schools student students teacher teachers university college class classes lesson
family friends country government company companies market markets product products price
customer customers employee employees manager managers project projects plan plans goal goals
sky sun moon star stars earth planet planets tree trees flower flowers animal animals dog dogs
cat cats bird birds fish horse horses ocean sea river rivers mountain mountains rain snow wind
weather season seasons summer winter spring autumn fall light dark color colors colour
word sentence sentences paragraph paragraphs essay poem poems article articles email emails
letter letters note notes title titles topic topics list steps reason tips guide tutorial
explain describe define compare contrast discuss analyze analyse evaluate recommend write
short brief detailed simple concise clearly exactly roughly approximately about because
therefore thus hence although though unless while whereas whether meanwhile otherwise
instead indeed perhaps maybe probably certainly actually basically finally firstly secondly
also furthermore moreover however nevertheless
helpful useful careful beautiful powerful successful wonderful happy sad angry afraid
interesting interested boring funny strange nice kind friendly honest polite rude smart clever
wise stupid young older age strong weak heavy light rich poor cheap beautiful ugly clean dirty
quiet loud soft deep wide narrow thick thin dry wet fresh sweet sour bitter tasty delicious
correct incorrect exact accurate precise efficient effective reliable robust scalable stable
unstable consistent random deterministic optional necessary ready complete incomplete unknown
known famous popular natural human social political economic financial legal medical
technical practical personal professional physical digital virtual online offline automatic
manual visible invisible similar different various unique entire following previous above
give explain summarise hello assist assistance reply replies respond responded describe
"""


def english_words() -> tuple[str, ...]:
    """The named English and technical words, deduplicated, in first-seen order."""
    return tuple(dict.fromkeys(w for w in _WORDS.split() if w.isascii() and w.isalpha()))
